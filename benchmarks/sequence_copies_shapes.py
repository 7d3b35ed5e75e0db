"""Sequence copies at micro-batch 1 on shapes other than the demo's (issue 44 item 3): the GPT step, TP 2 SP, over
the emulated link (one core per rank), variants interleaved over ROUNDS, all with the fused attention kernel
(``COC_FLASH_ATTN=1``: the kernel the copies' attention runs, so the ratio is the copies' own share):

    COC_FLASH_ATTN=1 (no copies), + COC_MULTI_COPY=2, + COC_MULTI_COPY=auto

Targets: 2 copies >= 1.15x the kernel alone where the copies pay; auto >= 0.98x the kernel alone on every shape
(it steps aside where they do not). Losses equal within 1e-5. Each copies run shows the block's decision.

    .venv/bin/python benchmarks/sequence_copies_shapes.py [--seq-length 2048] [--hidden-size 512]
        [--ffn-hidden-size 2048] [--num-query-groups G] [--rounds 2] [--link-rate 1gbit] [--steps 6]
"""

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
from demo import print_copies  # noqa: E402
from demo_runs import variant_runs  # noqa: E402

KERNEL = "COC_FLASH_ATTN=1"
VARIANTS = {KERNEL: {"COC_FLASH_ATTN": "1"},
            "COC_FLASH_ATTN=1 COC_MULTI_COPY=2": {"COC_FLASH_ATTN": "1", "COC_MULTI_COPY": "2"},
            "COC_FLASH_ATTN=1 COC_MULTI_COPY=auto": {"COC_FLASH_ATTN": "1", "COC_MULTI_COPY": "auto"}}
TARGETS = {"COC_FLASH_ATTN=1 COC_MULTI_COPY=2": 1.15, "COC_FLASH_ATTN=1 COC_MULTI_COPY=auto": 0.98}


def main(argv=None) -> int:
    from coc_inject.testbed.link import EmulatedLink

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--ffn-hidden-size", type=int, default=2048)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--link-rate", default="1gbit")
    args = parser.parse_args(argv)
    model = ["--seq-length", str(args.seq_length), "--micro-batch-size", "1", "--hidden-size", str(args.hidden_size),
             "--ffn-hidden-size", str(args.ffn_hidden_size), "--num-attention-heads", str(args.num_attention_heads)]
    if args.num_query_groups:
        model += ["--num-query-groups", str(args.num_query_groups)]
    shape = (f"seq {args.seq_length}, hidden {args.hidden_size}, FFN {args.ffn_hidden_size}"
             + (f", {args.num_query_groups} query groups" if args.num_query_groups else ""))
    EmulatedLink.check_available()
    with tempfile.TemporaryDirectory() as workdir, EmulatedLink(args.link_rate) as link:
        equal, medians = variant_runs(f"sequence copies at micro-batch 1, {shape}, over the emulated {args.link_rate} "
                                      "link", workdir, link, args.steps, model, args.rounds,
                                      {"off": {}, **VARIANTS}, {}, {}, show=print_copies)
    ok = equal
    for name, target in TARGETS.items():
        ratio = medians[KERNEL] / medians[name]
        ok &= ratio >= target
        print(f"{name} vs {KERNEL} alone: {ratio:.3f}x (target >= {target}x: {'met' if ratio >= target else 'missed'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
