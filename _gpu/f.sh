export PYTHONPATH=$PWD
timeout 100 python3 benchmarks/hook_overhead.py --out $OUT/ho 2>&1 | grep -E "^ +(none|floor|v2|v2_hooks_only|save_on_cpu|v1) |calls per"
timeout 420 python3 benchmarks/offload_benchmark.py --out $OUT/ob 2>&1 | tail -25
