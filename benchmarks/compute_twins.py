"""Where a variant's time goes besides communication: the training script's compute-only twin
(examples/compute_only.py: every floating-point collective a no-op) run with each coc-inject setting, so
its step time is that setting's compute C alone (the copies' turns, the pieces' smaller GEMMs, the
router per copy ...), beside off's C. Over the emulated link's pinning (one core per rank; the integer
collectives, the MoE counts, still cross the link), variants interleaved over ROUNDS. Fixed settings only:
on a network that costs nothing ``auto``'s trials would choose otherwise than in the job.

    .venv/bin/python benchmarks/compute_twins.py --model moe|dense [--rounds 2] [--steps 8]
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]
from demo import LINK_MODEL  # noqa: E402
from demo_runs import steady  # noqa: E402
from launch import SITE, clean_env, torchrun  # noqa: E402
from moe_copies import MODEL as MOE_MODEL  # noqa: E402

TWIN = ROOT / "examples" / "compute_only.py"
MODELS = {
    "moe": (MOE_MODEL, {"off": {}, "COC_MOE_OVERLAP=1": {"COC_MOE_OVERLAP": "1"},
                        "COC_MOE_OVERLAP=1 COC_MULTI_COPY=2": {"COC_MOE_OVERLAP": "1", "COC_MULTI_COPY": "2"},
                        "COC_MULTI_COPY=2": {"COC_MULTI_COPY": "2"}}),
    "dense": (LINK_MODEL, {"off": {}, "COC_PARALLEL_NUM=4": {"COC_PARALLEL_NUM": "4"},
                           "COC_MULTI_COPY=2": {"COC_MULTI_COPY": "2"}, "COC_MULTI_COPY=4": {"COC_MULTI_COPY": "4"}}),
}


def main(argv=None) -> int:
    from coc_inject.testbed.link import EmulatedLink

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="moe")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--link-rate", default="1gbit")
    args = parser.parse_args(argv)
    model, variants = MODELS[args.model]
    EmulatedLink.check_available()
    times: dict = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as workdir, EmulatedLink(args.link_rate) as link:
        for round_ in range(args.rounds):
            for index, (name, setting) in enumerate(variants.items()):
                out = Path(workdir) / f"twin-{index}-{round_}.json"
                env = clean_env(PYTHONPATH=str(SITE), COC_TUNE_CACHE="off", **setting) if setting else clean_env()
                print(f"== compute-only twin, {name}", flush=True)
                proc = torchrun(TWIN, ["--steps", str(args.steps), "--json", str(out), *model], env, workdir, link)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:])
                    raise SystemExit(f"compute_twins: the {name} twin failed (exit {proc.returncode})")
                times[name].append(1e3 * steady(json.loads(out.read_text())))
    base = statistics.median(times["off"])
    print(f"\n{'variant (compute-only twin)':<42} {'C ms':>8} {'vs off C':>9}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:<42} {median:8.1f} {median / base:8.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
