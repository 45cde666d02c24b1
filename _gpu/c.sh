export PYTHONPATH=$PWD
timeout 420 python3 benchmarks/frontier.py --workload gpt --out $OUT/fr 2>&1 | tail -45
