"""What each wing's ``auto`` trials cost at the first step: its extra time and extra peak memory.

    python benchmarks/trials_cost.py [--steps 3] [--json PATH]      (make bench-trials)

The tiny GPT script (examples/pretrain_tiny_gpt.py) under torchrun on 2 local CPU ranks (gloo, loopback),
a fresh tune cache each run (COC_TUNE_CACHE=off: every ``auto`` tries its candidates at the first call of
each shape, in step 1). Per wing, the ``auto`` run against the same job without trials: off (the linears,
the copies, the MoE pieces) or, for CP, the fixed ``COC_CP_ALGO=ring`` (Megatron's local attention has no
CP to compare with). Step 1's time of both, the later steps' median of both, and the peak resident memory
of the ranks (ru_maxrss, the larger of the two ranks: host memory, the trials' detached copies and
candidate runs included). One run per setting, one after another: a quick reading, not a tight figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from launch import SITE, clean_env, torchrun  # noqa: E402

SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"
RANK = ROOT / "benchmarks" / "trials" / "rank.py"
DENSE = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "1024", "--num-attention-heads", "4",
         "--seq-length", "256", "--micro-batch-size", "4", "--vocab-size", "256"]
CP = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
      "--seq-length", "1024", "--micro-batch-size", "1", "--vocab-size", "256", "--position-embedding-type", "rope",
      "--context-parallel-size", "2"]
MOE = ["--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "512", "--num-attention-heads", "4",
       "--seq-length", "256", "--micro-batch-size", "2", "--vocab-size", "256", "--num-experts", "4",
       "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "1", "--moe-router-topk", "2"]
# wing -> (model, the run without trials' variables (None: coc-inject off), the auto run's variables)
WINGS = {
    "linears (TP 2 SP)": (DENSE, None, {"COC_PARALLEL_NUM": "auto"}),
    "context-parallel (CP 2)": (CP, {"COC_CP_ALGO": "ring"}, {"COC_CP_ALGO": "auto"}),
    "multi-copy (TP 2 SP)": (DENSE, None, {"COC_MULTI_COPY": "auto"}),
    "moe (EP 2)": (MOE, None, {"COC_MOE_OVERLAP": "auto"}),
}


def run(model: list, variables: dict | None, steps: int, scratch: Path) -> dict:
    out = Path(tempfile.mkdtemp(dir=scratch))
    env = clean_env(TRIALS_COST_OUT=str(out), COC_TUNE_CACHE="off",
                    **({"PYTHONPATH": str(SITE), **variables} if variables is not None else {}))
    proc = torchrun(RANK, [str(SCRIPT), *model, "--steps", str(steps), "--json", str(out / "run.json")], env, ROOT)
    if proc.returncode:
        sys.exit(f"error: {variables or 'off'} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    times = json.loads((out / "run.json").read_text())["step_times"]
    rss = max(int(path.read_text()) for path in out.glob("rss-*.txt")) / 1024
    return {"first_ms": 1e3 * times[0], "later_ms": 1e3 * statistics.median(times[1:]), "peak_mib": rss}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows = {}
    print("| wing | without trials: step 1 / later ms, peak MiB | `auto`: step 1 / later ms, peak MiB "
          "| trials' extra time at step 1 | extra peak memory |\n|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for wing, (model, base, auto) in WINGS.items():
            before, after = run(model, base, args.steps, Path(scratch)), run(model, auto, args.steps, Path(scratch))
            rows[wing] = {"base": before, "auto": after, "base_env": base, "auto_env": auto}
            print(f"| {wing}: {' '.join(f'{k}={v}' for k, v in auto.items())} against "
                  f"{' '.join(f'{k}={v}' for k, v in base.items()) if base else 'off'} "
                  f"| {before['first_ms']:.0f} / {before['later_ms']:.0f}, {before['peak_mib']:.0f} "
                  f"| {after['first_ms']:.0f} / {after['later_ms']:.0f}, {after['peak_mib']:.0f} "
                  f"| **+{(after['first_ms'] - before['first_ms']) / 1e3:.2f} s** "
                  f"| **{after['peak_mib'] - before['peak_mib']:+.0f} MiB** |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
