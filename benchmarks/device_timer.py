"""On one GPU (make device-check): coc_inject.timer's CUDA paths against each other.

The synchronised median of a bf16 matmul agrees with the device's events within 25%, is longer than
the unsynchronised launch time (so the synchronisation waits for the work), and the MAX over a
1-rank NCCL group returns the values unchanged from the GPU. Exits 1 when any of that fails.
"""
import json, os, sys
import torch, torch.distributed as dist
from coc_inject import timer
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29555")
dist.init_process_group("nccl", rank=0, world_size=1)
device = torch.device("cuda", 0); torch.cuda.set_device(device)
out = {}
for n in (4096, 8192):
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16); b = torch.randn_like(a)
    fn = lambda: a @ b
    for _ in range(3): fn()
    _, wall = timer.median(fn, 10, device)
    _, unsynced = timer.median(fn, 10, None)          # no device sync: launch time only
    t = timer.Timer(device)
    event = sorted(t(fn)[1] for _ in range(10))[5]
    worst = timer.slowest([wall, event], device)
    out[n] = {"median_sync_ms": wall * 1e3, "event_ms": event * 1e3, "no_sync_ms": unsynced * 1e3,
              "tflops_sync": 2 * n**3 / wall / 1e12, "slowest": [w * 1e3 for w in worst]}
print(json.dumps(out, indent=1))
ok = all(abs(v["median_sync_ms"] - v["event_ms"]) / v["event_ms"] < 0.25 and v["no_sync_ms"] < v["median_sync_ms"]
         and abs(v["slowest"][0] - v["median_sync_ms"]) < 1e-6 for v in out.values())
print("TIMER CHECK", "PASS" if ok else "FAIL"); dist.destroy_process_group(); sys.exit(0 if ok else 1)
