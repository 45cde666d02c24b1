export PYTHONPATH=$PWD
timeout 280 python3 benchmarks/frontier.py --workload gpt --out $OUT/fr 2>&1 | grep -A12 "fastest configuration per method"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/plan 2>&1 | tail -2
