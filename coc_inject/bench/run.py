"""``coc-inject bench``: unpatched Megatron vs CoC through the real layers, in one run.

Where it runs:
* default: 2 local CPU ranks (gloo) over plain loopback;
* ``--link 1gbit``: the 2 ranks in two network namespaces joined by a rate-limited veth pair,
  each pinned to its own core (root; see coc_inject.testbed.link);
* under ``torchrun`` (RANK/WORLD_SIZE set): every rank of the job on its device (CUDA/NPU,
  NCCL/HCCL), timed with device events.

Variants: unpatched Megatron, each ``--chunks`` count, and ``auto`` (``COC_PARALLEL_NUM=auto``
with a fresh temporary tune cache: its trials run once before the timed repetitions, which
then measure the N it chose; see coc_inject.bench.cases.linears).

Writes a table to stdout, ``bench.json`` (raw per-repetition times and the figures) and
``bench.png`` (speedup vs N per case, timeline of one call) into ``--out``; each other case
its own (coc_inject.bench.cases).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from coc_inject import log
from coc_inject.bench import cases
from coc_inject.testbed import ranks
from coc_inject.testbed.link import EmulatedLink, LinkError

CHUNKS_ALLOWED = "an integer >= 1 (a fixed chunk count; 1 = Megatron's path behind the wrapper) or auto"
DEFAULT_CASES = ("row", "row-sp", "column-sp")


def chunk_variant(text: str):
    """A ``--chunks`` word: an int >= 1 or "auto"."""
    word = text.strip().lower()
    if word == "auto":
        return word
    if word.isascii() and word.isdigit() and int(word) >= 1:
        return int(word)
    raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected {CHUNKS_ALLOWED}")  # argparse names --chunks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="coc-inject bench", description=log.help_text(__doc__.split("\n\n")[0]))
    parser.add_argument("--link", metavar="RATE", help="emulate a link of this rate between the 2 ranks, "
                        "e.g. 1gbit (root only)")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(cases.CASES),
                        help="linear layer cases, and/or attention: context-parallel core attention, every "
                             "algorithm (writes attention.json / attention.png), and/or layer: a whole "
                             "TransformerBlock forward + backward, Megatron vs CoC vs multi-copy vs both, with the "
                             "exposed communication (writes layer.json / layer.png), and/or moe: one MoE layer, "
                             "Megatron's alltoall dispatcher vs the pieces vs auto, with the pipelining limit "
                             "(writes moe.json / moe.png); each a module of coc_inject.bench.cases")
    parser.add_argument("--chunks", nargs="+", type=chunk_variant, default=[1, 2, 4, 8, "auto"],
                        help="fixed chunk counts and/or auto (COC_PARALLEL_NUM=auto, fresh tune cache; "
                             "default: 1 2 4 8 auto)")
    parser.add_argument("--shape", nargs=3, type=int, default=[4096, 1024, 1024], metavar=("M", "K", "N"),
                        help="per-rank forward matmul [M, K] x [K, N] (M: all rows of the sequence)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU rank")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--startup-reps", type=int, default=40,
                        help="repetitions of the bootstrap start-up measurement (0: skip)")
    for module in cases.modules():
        if hasattr(module, "add_options"):
            module.add_options(parser)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.link and not ranks.under_torchrun():
        try:
            EmulatedLink.check_available()
        except LinkError as error:
            print(f"coc-inject bench: {error}", file=sys.stderr)
            return 2
    for module in cases.modules(args.cases):
        code = module.bench(args)
        if code:
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
