"""Multi-copy through MoE blocks (issue 35 item 2): the tiny GPT training script with every MLP a mixture
of 8 experts (top-4, alltoall dispatcher, Megatron's default aux_loss), TP 2 with sequence parallelism x
EP 2 on 2 ranks, over the emulated link (one core per rank), variants interleaved over ROUNDS:

    off, COC_MOE_OVERLAP=auto, COC_MOE_OVERLAP=auto + COC_MULTI_COPY=2, COC_MOE_OVERLAP=auto + COC_MULTI_COPY=auto

Target: copies + COC_MOE_OVERLAP=auto >= 1.10x COC_MOE_OVERLAP=auto alone; losses equal to off within 1e-5.

``--measure``: every run measures its communication (COC_MEASURE=1) and the table of each wing's exposed
and hidden share follows, with the step's compute C from the script's compute-only twin and each variant's
share of the limit max(C, M): where the time of the copies over the pieces goes (#44 item 2).

    .venv/bin/python benchmarks/moe_copies.py [--rounds 3] [--link-rate 1gbit] [--steps 10] [--measure]
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import demo_exposure  # noqa: E402
from demo import print_copies  # noqa: E402
from demo_runs import variant_runs  # noqa: E402

MODEL = ["--num-experts", "8", "--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
         "--expert-tensor-parallel-size", "1",         "--moe-router-topk", "4", "--num-layers", "2", "--hidden-size", "512", "--ffn-hidden-size", "768",
         "--num-attention-heads", "8", "--seq-length", "512", "--micro-batch-size", "4", "--vocab-size", "256"]
VARIANTS = {"off": {}, "COC_MOE_OVERLAP=auto": {"COC_MOE_OVERLAP": "auto"},
            "COC_MOE_OVERLAP=auto COC_MULTI_COPY=2": {"COC_MOE_OVERLAP": "auto", "COC_MULTI_COPY": "2"},
            "COC_MOE_OVERLAP=auto COC_MULTI_COPY=auto": {"COC_MOE_OVERLAP": "auto", "COC_MULTI_COPY": "auto"}}
TARGET = 1.10  # issue 35: copies + COC_MOE_OVERLAP=auto >= 1.10x COC_MOE_OVERLAP=auto alone


def main(argv=None) -> int:
    from coc_inject.testbed.link import EmulatedLink

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--link-rate", default="1gbit")
    parser.add_argument("--measure", action="store_true", help="each wing's exposed communication, and the limit")
    args = parser.parse_args(argv)
    EmulatedLink.check_available()
    with tempfile.TemporaryDirectory() as workdir, EmulatedLink(args.link_rate) as link:
        measured = demo_exposure.measuring(workdir, link, args.steps, MODEL) if args.measure else None
        ok, medians = variant_runs(f"MoE blocks as copies over the emulated {args.link_rate} link (TP 2 SP x EP 2)",
                                   workdir, link, args.steps, MODEL, args.rounds, VARIANTS, {}, {},
                                   show=print_copies, measured=measured)
    demo_exposure.print_tables()
    base = medians["COC_MOE_OVERLAP=auto"]
    for name in VARIANTS:
        if "COC_MULTI_COPY" in name:
            ratio = base / medians[name]
            print(f"{name} vs COC_MOE_OVERLAP=auto alone: {ratio:.3f}x (target >= {TARGET}x: "
                  f"{'met' if ratio >= TARGET else 'missed'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
