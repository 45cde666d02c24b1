export PYTHONPATH=$PWD
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/plan tests/integration/test_benchmarks.py --tb=short 2>&1 | tail -3
timeout 280 python3 benchmarks/frontier.py --workload gpt --out $OUT/fr 2>&1 | grep -A12 "fastest configuration per method"
