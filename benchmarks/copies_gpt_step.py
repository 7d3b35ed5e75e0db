"""Multi-copy on the whole GPT step at another FFN width (issue 35's regression check: the bands' backward on
a 4x-hidden FFN). The demo's link model (TP 2 SP, hidden 512, micro-batch 16, seq 256) with
``--ffn-hidden-size`` (default 2048 = 4x), over the emulated link (one core per rank), interleaved over ROUNDS:

    off, COC_PARALLEL_NUM=auto, COC_MULTI_COPY=2, COC_MULTI_COPY=2 + COC_PARALLEL_NUM=auto

Targets: copies >= 1.15x off, copies + CoC auto >= 1.05x CoC auto alone; losses equal to off within 1e-5.
Every run measures its communication (COC_MEASURE=1) and the table of each wing's hidden share follows.

    .venv/bin/python benchmarks/copies_gpt_step.py [--rounds 2] [--ffn-hidden-size 2048] [--link-rate 1gbit]
        [--seq-length S] [--micro-batch-size B] [--auto]
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
import demo_exposure  # noqa: E402
from demo import LINK_MODEL, LINK_STEPS, copies_runs  # noqa: E402

VARIANTS = {"off": {}, "COC_PARALLEL_NUM=auto": {"COC_PARALLEL_NUM": "auto"},
            "COC_MULTI_COPY=2": {"COC_MULTI_COPY": "2"},
            "COC_MULTI_COPY=2 + COC_PARALLEL_NUM=auto": {"COC_MULTI_COPY": "2", "COC_PARALLEL_NUM": "auto"}}
AUTO_VARIANTS = {"COC_MULTI_COPY=auto": {"COC_MULTI_COPY": "auto"},
                 "COC_MULTI_COPY=auto + COC_PARALLEL_NUM=auto": {"COC_MULTI_COPY": "auto", "COC_PARALLEL_NUM": "auto"}}
TARGETS = {"COC_MULTI_COPY=2": 1.15}


def main(argv=None) -> int:
    from coc_inject.testbed.link import EmulatedLink

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ffn-hidden-size", type=int, default=2048)
    parser.add_argument("--link-rate", default="1gbit")
    parser.add_argument("--seq-length", type=int, default=None, help="default: the demo's link model's (256)")
    parser.add_argument("--micro-batch-size", type=int, default=None, help="default: the demo's link model's (16)")
    parser.add_argument("--auto", action="store_true",
                        help="also COC_MULTI_COPY=auto, alone and with COC_PARALLEL_NUM=auto (none, 2 or 4 copies)")
    args = parser.parse_args(argv)
    model = list(LINK_MODEL)
    model[model.index("--ffn-hidden-size") + 1] = str(args.ffn_hidden_size)
    for flag, value in (("--seq-length", args.seq_length), ("--micro-batch-size", args.micro_batch_size)):
        if value is not None:
            model[model.index(flag) + 1] = str(value)
    variants = dict(VARIANTS, **(AUTO_VARIANTS if args.auto else {}))
    EmulatedLink.check_available()
    with tempfile.TemporaryDirectory() as workdir, EmulatedLink(args.link_rate) as link:
        ok = copies_runs(f"multi-copy on the GPT step ({' '.join(model)}), over the emulated {args.link_rate} link",
                         workdir, link, LINK_STEPS, model, args.rounds, variants, {}, TARGETS)
    demo_exposure.print_tables()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
