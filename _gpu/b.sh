R=$PWD
export PYTHONPATH=$R
timeout 300 python3 benchmarks/hf_llama_benchmark.py --batch 2 --out $OUT/hf2 2>&1 | tail -22
timeout 270 python3 benchmarks/hf_llama_benchmark.py --batch 1 --stat lq --budgets 0.8,0.6 --out $OUT/hf1 2>&1 | tail -18
