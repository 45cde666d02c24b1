R=$PWD
PYTHONPATH=$R timeout 230 python3 -m pytest -q -p no:cacheprovider -m gpu tests/plan tests/v2 tests/integration tests/test_doc_blocks.py tests/optim/test_stream_update.py 2>&1 | grep -E "passed|failed|FAILED|Error" | tail -8
for i in 1 2; do for t in _old .; do
  echo "== $t round $i"
  cd $R/$t && PYTHONPATH=$PWD timeout 70 python3 benchmarks/hook_overhead.py --methods floor,v2,v2_hooks_only --iters 40 --out $OUT/ho_${i}_$(basename $t) 2>&1 | grep -E "^ +(floor|v2|v2_hooks_only) |calls per"
done; done
cd $R && PYTHONPATH=$R timeout 90 python3 benchmarks/hf_llama_benchmark.py --ks 2,4 --budgets "" --no-match-hf --out $OUT/hf1 2>&1 | grep -E "^ +(none|apply)|spread|round" | tail -8
