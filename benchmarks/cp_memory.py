"""Bytes the attention keeps for backward per rank, against the sequence length: Megatron's local
attention at CP=1 and each coc-inject algorithm at CP=2 (real megatron-core layers, 2 gloo ranks).

    python benchmarks/cp_memory.py            (make bench-cp-memory)

Counted with torch.autograd.graph.saved_tensors_hooks around one attention call (distinct storages),
1 sequence, 4 heads of 16; prints a markdown table for benchmarks/RESULTS.md.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.dist_harness import RankPool  # noqa: E402

SEQUENCES = (128, 256, 512, 1024, 2048)
ALGORITHMS = ("ring", "ulysses", "allgather")


def main():
    pool = RankPool(2)
    try:
        rows = []
        for seq in SEQUENCES:
            megatron = max(pool.run("tests.context_parallel.cp_gpt_cases:saved_attention_bytes", tp=1, cp=1, seq=seq))
            cp = {a: max(pool.run("tests.context_parallel.cp_gpt_cases:saved_attention_bytes", tp=1, cp=2, coc={"cp_algo": a},
                                  seq=seq)) for a in ALGORITHMS}
            rows.append((seq, megatron, cp))
            print(f"seq {seq} done", file=sys.stderr, flush=True)
    finally:
        pool.close()
    print("| seq | Megatron CP=1 | " + " | ".join(f"{a} CP=2 (ratio to CP=1)" for a in ALGORITHMS) + " |")
    print("|---|---|" + "---|" * len(ALGORITHMS))
    for seq, megatron, cp in rows:
        cells = " | ".join(f"{cp[a] / 1024:.0f} KiB ({cp[a] / megatron:.3f})" for a in ALGORITHMS)
        print(f"| {seq} | {megatron / 1024:.0f} KiB | {cells} |")


if __name__ == "__main__":
    main()
