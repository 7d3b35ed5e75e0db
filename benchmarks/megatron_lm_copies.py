"""Megatron-LM's own ``pretrain_gpt.py`` trains the same with multi-copy parallel (``COC_MULTI_COPY=2``) as without.

    python benchmarks/megatron_lm_copies.py [MEGATRON_LM_CHECKOUT] [--iters 4] [--keep DIR] [--only CASE ...]

Issue #35's end-to-end figure, on 4 CPU ranks (torchrun, gloo; Megatron's CUDA-only calls shimmed by
benchmarks/megatron_lm/cpu_shims.py in both runs), a tiny GPT (RoPE, mock data, no dropout, TP 2 with
sequence parallelism). Each case runs off (coc-inject not on PYTHONPATH) and with its bootstrap on
PYTHONPATH and ``COC_MULTI_COPY=2`` (no tune cache), as a user runs it:

- ``dense-mb1``: dense x DP 2 at ``--micro-batch-size 1``, fp32: the blocks run sequence copies;
- ``moe-mb2`` / ``moe-mb1``: 4 experts top-2, ``seq_aux_loss``, EP 2, alltoall, fp32 (batch / sequence copies);
- ``recompute-mb2``: dense x DP 2, ``--recompute-granularity full --recompute-method uniform
  --recompute-num-layers 1``, micro-batch 2, fp32: batch copies, the backward in bands (no "backward in turn");
- ``dense-mb1-bf16``: ``dense-mb1`` in ``--bf16``: measured, not judged (the copies' halves round differently).

Prints each iteration's ``lm loss`` and ``grad norm`` of both runs and rank 0's first-step multi-copy
summary. Exits 0 only if every fp32 case's losses and grad norms agree within RTOL (relative) at every
iteration and its summary says the copies ran as the case expects (the split, no block without copies,
and for the recompute case no backward in turn).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_lm_gpu_defaults import NORM, run  # noqa: E402
from megatron_lm_moe import checkout_dir, losses  # noqa: E402

RTOL = 1e-5
SUMMARY = re.compile(r"^\[coc-inject rank 0\].*first step.*$", re.MULTILINE)
COPIES = re.compile(r"multi-copy [^;]*")
# The routing losses Megatron's tracker logs for an MoE model, each iteration (combined over the copies).
TRACKED = re.compile(r"\| (\w+_loss): ([0-9.eE+-]+)")
ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|")

COMMON = """
--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4
--seq-length 64 --max-position-embeddings 64 --position-embedding-type rope
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --transformer-impl local
--eval-iters 0 --eval-interval 1000 --log-interval 1 --seed 1234
--lr 1e-3 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0
--hidden-dropout 0 --attention-dropout 0 --use-cpu-initialization --no-gradient-accumulation-fusion
--distributed-backend gloo --no-bias-dropout-fusion
--no-masked-softmax-fusion --no-bias-gelu-fusion --no-persist-layer-norm --no-rope-fusion
--mock-data --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size 256
""".split()
MOE = ("--num-experts 4 --moe-router-topk 2 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 "
       "--expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --expert-tensor-parallel-size 1").split()
RECOMPUTE = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()


def batch(micro: int) -> list:
    """micro-batch ``micro``, two micro-batches per step on each of the 2 data-parallel ranks."""
    return ["--micro-batch-size", str(micro), "--global-batch-size", str(4 * micro)]


# name: (arguments, the split the copies must run, must the backward run in bands, judged against RTOL)
CASES = {
    "dense-mb1": (batch(1), "sequence", False, True),
    "moe-mb2": (batch(2) + MOE, "batch", False, True),
    "moe-mb1": (batch(1) + MOE, "sequence", False, True),
    "recompute-mb2": (batch(2) + RECOMPUTE, "batch", True, True),
    "dense-mb1-bf16": (batch(1) + ["--bf16"], "sequence", False, False),
}


def summary_problems(text: str, split: str, bands: bool) -> tuple:
    """Rank 0's first-step summary, and what in it contradicts the copies having run as ``split`` copies."""
    found = SUMMARY.findall(text)
    if not found:
        return "", ["no first-step summary from rank 0"]
    line = found[0]
    copies = COPIES.search(line)
    problems = []
    if not copies or f"{split} split" not in copies.group(0):
        problems.append(f"the summary names no {split} split")
    if "no copies for" in line:
        problems.append("a block call ran without copies")
    if bands and "backward in turn" in line:
        problems.append("the copies' backward ran in turn")
    return line, problems


def tracked(text: str) -> dict:
    """{(iteration, name): value} of the routing losses Megatron's tracker logs (load_balancing_loss, ...)."""
    values = {}
    for line in text.splitlines():
        iteration = ITERATION.search(line)
        if iteration:
            values.update({(int(iteration.group(1)), name): float(v) for name, v in TRACKED.findall(line)})
    return values


def compare(case: str, off_text: str, on_text: str, iters: int, judged: bool) -> tuple:
    """Print the two runs side by side; (the losses and grad norms agree, max |loss diff|, max |norm diff|)."""
    off_loss, on_loss = losses(off_text), losses(on_text)
    off_norm, on_norm = ({int(i): float(v) for i, v in NORM.findall(t)} for t in (off_text, on_text))
    print(f"\n{case}: {'iter':>4}  {'lm loss off':>14}  {'copies 2':>14}  {'|diff|':>8}  "
          f"{'grad norm off':>14}  {'copies 2':>14}  {'|diff|':>8}")
    every = list(range(1, iters + 1))
    good = sorted(off_loss) == sorted(on_loss) == sorted(off_norm) == sorted(on_norm) == every
    loss_diff = norm_diff = 0.0
    for i in every:
        a, b = off_loss.get(i, float("nan")), on_loss.get(i, float("nan"))
        c, d = off_norm.get(i, float("nan")), on_norm.get(i, float("nan"))
        good = good and abs(a - b) <= RTOL * abs(a) and abs(c - d) <= RTOL * abs(c)
        loss_diff, norm_diff = max(loss_diff, abs(a - b)), max(norm_diff, abs(c - d))
        print(f"{case}: {i:>4}  {a:>14.7e}  {b:>14.7e}  {abs(a - b):>8.1e}  {c:>14.7e}  {d:>14.7e}  {abs(c - d):>8.1e}")
    off_tracked, on_tracked = (tracked(t) for t in (off_text, on_text))
    good = good and sorted(off_tracked) == sorted(on_tracked)
    for key in sorted(off_tracked):
        a, b = off_tracked[key], on_tracked.get(key, float("nan"))
        good = good and abs(a - b) <= RTOL * abs(a)
        if b != a:
            print(f"{case}: {key[0]:>4}  {key[1]}: off {a:.6e}, copies {b:.6e}")
    if off_tracked:
        names = sorted({name for _, name in off_tracked})
        print(f"{case}: Megatron's logged {', '.join(names)}: "
              + ("equal at every iteration" if all(on_tracked.get(k) == v for k, v in off_tracked.items())
                 else "see above"))
    verdict = ("equal" if good else "NOT equal") + f" within {RTOL:g} relative" if judged else "measured"
    print(f"{case}: max |loss diff| {loss_diff:.2e}, max |grad norm diff| {norm_diff:.2e} ({verdict})")
    return good, loss_diff, norm_diff


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?", help="Megatron-LM checkout (default: extracted from the mirror)")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--keep", help="write the logs and reports here (default: a temporary directory)")
    parser.add_argument("--only", nargs="+", choices=list(CASES), help="run these cases (default: all)")
    args = parser.parse_args()
    failed = []
    with tempfile.TemporaryDirectory(prefix="megatron-lm-copies-") as scratch:
        out = Path(args.keep or scratch).resolve()
        out.mkdir(parents=True, exist_ok=True)
        checkout = checkout_dir(args.checkout, Path(scratch))
        for case, (extra, split, bands, judged) in CASES.items():
            if args.only and case not in args.only:
                continue
            arguments = COMMON + extra + ["--train-iters", str(args.iters)]
            try:
                off = run(f"{case}-off", checkout, out, arguments, None)
                on = run(f"{case}-copies", checkout, out, arguments, {"COC_MULTI_COPY": "2"})
            except SystemExit as error:  # run_logged names the run that failed and shows its log's tail
                print(f"{case}: {error}")
                failed.append(case)
                continue
            equal = compare(case, off, on, args.iters, judged)[0]
            line, problems = summary_problems(on, split, bands)
            print(f"{case}:   {line[:400]}")
            for problem in problems:
                print(f"{case}:   PROBLEM: {problem}")
            if "[coc-inject" in off:
                problems.append("coc-inject spoke in the run meant without it")
            if problems or (judged and not equal):
                failed.append(case)
    print("\nfailed: " + ", ".join(failed) if failed else "\nevery case as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
