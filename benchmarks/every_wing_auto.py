"""Every wing on ``auto`` against the best single wing on ``auto`` (issue 44 item 4), the whole training step
over the emulated link (one core per rank) or loopback, variants interleaved over ROUNDS:

* dense (the demo's link model, TP 2 SP, hidden 512, micro-batch 16, seq 256, ``--ffn-hidden-size``):
  off, ``COC_PARALLEL_NUM=auto``, ``COC_MULTI_COPY=auto``, both;
* moe (benchmarks/moe_copies.py's model: 8 experts top-4, TP 2 SP x EP 2): off, ``COC_MOE_OVERLAP=auto``,
  ``COC_MULTI_COPY=auto``, all three on auto.

Target: every wing on auto >= 0.98x the best single wing's auto in the same run; losses equal to off.
Each copies run shows the block's decision and its trials' times.

    .venv/bin/python benchmarks/every_wing_auto.py [--part dense|moe|both] [--rounds 2] [--ffn-hidden-size 512]
                                                   [--link-rate 1gbit | --loopback] [--steps 10]
"""

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples"), str(ROOT / "benchmarks")]
from demo import LINK_MODEL, print_copies  # noqa: E402
from demo_runs import variant_runs  # noqa: E402
from moe_copies import MODEL as MOE_MODEL  # noqa: E402

TARGET = 0.98
PARTS = {
    "dense": {"COC_PARALLEL_NUM=auto": {"COC_PARALLEL_NUM": "auto"}, "COC_MULTI_COPY=auto": {"COC_MULTI_COPY": "auto"},
              "every wing auto": {"COC_PARALLEL_NUM": "auto", "COC_MULTI_COPY": "auto"}},
    "moe": {"COC_MOE_OVERLAP=auto": {"COC_MOE_OVERLAP": "auto"}, "COC_MULTI_COPY=auto": {"COC_MULTI_COPY": "auto"},
            "every wing auto": {"COC_MOE_OVERLAP": "auto", "COC_MULTI_COPY": "auto", "COC_PARALLEL_NUM": "auto"}},
}


def compare(part: str, medians: dict) -> bool:
    singles = {name: medians[name] for name in PARTS[part] if name != "every wing auto"}
    best = min(singles, key=singles.get)
    ratio = singles[best] / medians["every wing auto"]
    print(f"{part}: every wing auto vs the best single wing ({best}): {ratio:.3f}x "
          f"(target >= {TARGET}x: {'met' if ratio >= TARGET else 'missed'}); vs off {medians['off'] / medians['every wing auto']:.3f}x")
    return ratio >= TARGET


def main(argv=None) -> int:
    from coc_inject.testbed.link import EmulatedLink

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("dense", "moe", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--ffn-hidden-size", type=int, default=512)
    parser.add_argument("--link-rate", default="1gbit")
    parser.add_argument("--loopback", action="store_true", help="no emulated link: the collectives over loopback")
    args = parser.parse_args(argv)
    dense = list(LINK_MODEL)
    dense[dense.index("--ffn-hidden-size") + 1] = str(args.ffn_hidden_size)
    models = {"dense": dense, "moe": MOE_MODEL}
    parts = list(PARTS) if args.part == "both" else [args.part]
    where = "loopback" if args.loopback else f"the emulated {args.link_rate} link"
    ok = True
    if not args.loopback:
        EmulatedLink.check_available()
    with tempfile.TemporaryDirectory() as workdir:
        for part in parts:
            link = None if args.loopback else EmulatedLink(args.link_rate)
            with link if link is not None else contextlib.nullcontext():
                equal, medians = variant_runs(f"{part}: every wing on auto over {where}", workdir, link, args.steps,
                                              models[part], args.rounds, {"off": {}, **PARTS[part]}, {}, {},
                                              show=print_copies)
            ok = compare(part, medians) and equal and ok
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
