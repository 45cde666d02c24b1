"""Record and draw the timeline of real training steps (compute vs copies, memory over time).

    python benchmarks/timeline.py --ks 2,6 --out bench_out      # CUDA only

Writes ``timeline_k{k}.png`` and ``timeline_k{k}.json`` per k on the reference workload (README
"Performance").
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from cpu_offload.examples.gpt import build_model, make_input, reference_config
from cpu_offload.tools.timeline import plot_timeline, record_step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ks", default="2,6")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--out", default="bench_out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the timeline is recorded from CUDA events: run it on a CUDA machine")
    cfg = reference_config() if args.layers is None else reference_config().with_(layers=args.layers)
    model = build_model(cfg, device="cuda")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    x = make_input(cfg, device="cuda", requires_grad=False)
    out = Path(args.out)
    for k in (int(v) for v in args.ks.split(",")):
        data = record_step(model, x, k)
        end = data["milestones"][-1]["ms"]
        moved = sum(c["bytes"] for c in data["copies"]) / 2**30
        (out / f"timeline_k{k}.json").parent.mkdir(parents=True, exist_ok=True)
        (out / f"timeline_k{k}.json").write_text(json.dumps(data))
        png = plot_timeline(data, out / f"timeline_k{k}.png",
                            f"k={k} of {cfg.layers} layers offloaded: step {end:.1f} ms, "
                            f"{moved:.2f} GiB copied (both ways)")
        print(f"k={k}: step {end:.1f} ms, {len(data['copies'])} copies, {moved:.2f} GiB -> {png}")


if __name__ == "__main__":
    main()
