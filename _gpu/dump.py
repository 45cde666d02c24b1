import sys, os, pickle
sys.path.insert(0, "benchmarks")
import frontier
from bench_common import BenchDevice, prepare_determinism
args = frontier.parse_args(["--workload", "gpt"])
device = BenchDevice.from_flag("auto")
prepare_determinism(device)
out = {}
for name in ("gpt", "hf"):
    args.batch = None if name == "gpt" else 2
    wl, desc, min_size = frontier.build_workload(name, args, device)
    wl.step()
    notes = []
    prof = frontier.profile(wl, device, min_size, None, notes)
    out[name] = prof
    print(name, notes[-1])
    del wl
    device.free_memory()
pickle.dump(out, open(os.path.join(os.environ.get("OUT", "."), "profiles.pkl"), "wb"))
