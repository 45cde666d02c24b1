"""``benchmarks/cpu_update_bench.py`` (the CPU update microbenchmark) stays runnable on a CPU,
and its ``--compare`` loads another checkout's bucket update (here: this one)."""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_cpu_update_bench_smoke(tmp_path):
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    import cpu_update_bench as bench

    micro = bench.main(["--threads", "1", "--elems", str(2**16), "--reps", "1", "--chunks", "0,0.0625",
                        "--compare", str(REPO), "--out", str(tmp_path / "micro.json")])
    paths = {m["path"] for m in micro}
    assert {"raw fused AdamW", "update, whole bucket", "old update, whole bucket",
            "update, chunk 0.0625 MiB", "steps only, chunk 0.0625 MiB",
            "convert in (bucket pass)", "write back (bucket pass)"} <= paths
    assert all(m["vs_raw"] > 0 and m["faults_per_call"] >= 0 for m in micro)
    assert (tmp_path / "micro.json").exists()
