"""Megatron-LM's own ``pretrain_gpt.py`` under a GPU job's defaults trains the same with every wing on
``auto`` as without coc-inject.

    python benchmarks/megatron_lm_gpu_defaults.py [MEGATRON_LM_CHECKOUT] [--iters 4] [--keep DIR] [--only dense|moe]

A GPU job's defaults, on 4 CPU ranks (torchrun, gloo): bf16, the distributed optimizer with
``--overlap-grad-reduce --overlap-param-gather``, gradient accumulation fusion on (apex's kernel: the
tests' CPU stand-in, tests/fakes/fused_wgrad.py, registered by the CPU shims), gradient clipping.
Two models: dense (TP 2 with sequence parallelism x DP 2, micro-batch 4) and MoE (TP 2 SP x EP 2,
4 experts, alltoall dispatcher, aux loss). Each is run off (coc-inject not on PYTHONPATH) and with
its bootstrap on PYTHONPATH and every wing of the model on ``auto`` (COC_PARALLEL_NUM, COC_MULTI_COPY,
COC_MOE_OVERLAP), no tune cache, so the trials run at the first step. Prints each iteration's
``lm loss`` and ``grad norm`` of both; exits 0 only if the losses agree within LOSS_RTOL and the grad
norms within NORM_ATOL at every iteration. The auto trials run on the job's layers at the first step:
a trial that left its weight gradients in ``main_grad`` shows as a first-step grad norm far from off's.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_lm_moe import checkout_dir, losses, run_logged  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WRAPPER = ROOT / "benchmarks" / "megatron_lm" / "run_pretrain.py"
LOSS_RTOL = 1e-5
NORM_ATOL = 1e-3
NORM = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| grad norm: ([0-9.eE+-]+) \|")

COMMON = """
--num-layers 2 --hidden-size 64 --ffn-hidden-size 256 --num-attention-heads 4
--seq-length 64 --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 16
--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1 --transformer-impl local
--eval-iters 0 --eval-interval 1000 --log-interval 1 --seed 1234
--lr 1e-3 --lr-decay-style constant --weight-decay 0.0 --clip-grad 1.0 --bf16
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--hidden-dropout 0 --attention-dropout 0 --use-cpu-initialization
--distributed-backend gloo --no-bias-dropout-fusion
--no-masked-softmax-fusion --no-bias-gelu-fusion --no-persist-layer-norm --no-rope-fusion
--mock-data --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size 256
""".split()
MODELS = {
    "dense": ([], {"COC_PARALLEL_NUM": "auto", "COC_MULTI_COPY": "auto"}),
    "moe": ("--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --expert-model-parallel-size 2 "
            "--moe-token-dispatcher-type alltoall --expert-tensor-parallel-size 1".split(),
            {"COC_PARALLEL_NUM": "auto", "COC_MOE_OVERLAP": "auto"}),
}


def run(name: str, checkout: Path, out: Path, arguments: list, coc: dict | None) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COC_")}
    env["PYTHONPATH"] = os.pathsep.join(([str(ROOT / "sitecustomize")] if coc else []) + [str(checkout)])
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # what Megatron asks of a GPU job with TP (its argument checks)
    if coc:
        env.update(coc, COC_TUNE_CACHE="off", COC_REPORT=str(out / f"{name}-report-{{rank}}.json"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
               str(WRAPPER), str(checkout / "pretrain_gpt.py"), *arguments]
    said = " ".join(f"{k}={v}" for k, v in coc.items()) if coc else "coc-inject off"
    return run_logged(name, command, env, out, said)


def compare(model: str, off_text: str, on_text: str, iters: int) -> bool:
    off_loss, on_loss = losses(off_text), losses(on_text)
    off_norm, on_norm = ({int(i): float(v) for i, v in NORM.findall(t)} for t in (off_text, on_text))
    print(f"\n{model}: {'iter':>4}  {'lm loss off':>12}  {'auto':>12}  {'grad norm off':>13}  {'auto':>8}")
    good = sorted(off_loss) == sorted(on_loss) == sorted(off_norm) == sorted(on_norm) == list(range(1, iters + 1))
    for i in range(1, iters + 1):
        a, b = off_loss.get(i, float("nan")), on_loss.get(i, float("nan"))
        c, d = off_norm.get(i, float("nan")), on_norm.get(i, float("nan"))
        good = good and abs(a - b) <= LOSS_RTOL * abs(a) and abs(c - d) <= NORM_ATOL
        print(f"{model}: {i:>4}  {a:>12.6e}  {b:>12.6e}  {c:>13.3f}  {d:>8.3f}")
    print(f"{model}: {'equal' if good else 'NOT equal'} (losses within {LOSS_RTOL:g} relative, grad norms within "
          f"{NORM_ATOL:g})")
    for line in on_text.splitlines():
        if line.startswith("[coc-inject rank 0]") and ("auto:" in line or "first step" in line) or "[cpu shims]" in line:
            print(f"{model}:   {line[:240]}")
    return good


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?", help="Megatron-LM checkout (default: extracted from the mirror)")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--keep", help="write the logs and reports here (default: a temporary directory)")
    parser.add_argument("--only", choices=sorted(MODELS))
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="megatron-lm-gpu-defaults-") as scratch:
        out = Path(args.keep or scratch).resolve()
        out.mkdir(parents=True, exist_ok=True)
        checkout = checkout_dir(args.checkout, Path(scratch))
        for model, (extra, coc) in MODELS.items():
            if args.only and model != args.only:
                continue
            arguments = COMMON + extra + ["--train-iters", str(args.iters)]
            off = run(f"{model}-off", checkout, out, arguments, None)
            on = run(f"{model}-auto", checkout, out, arguments, coc)
            results.append(compare(model, off, on, args.iters))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
