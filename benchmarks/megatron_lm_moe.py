"""Megatron-LM's own ``pretrain_gpt.py`` trains an MoE GPT the same with coc-inject's MoE pieces as without.

    python benchmarks/megatron_lm_moe.py [MEGATRON_LM_CHECKOUT] [--iters 4] [--keep DIR]

Two runs of 2 CPU ranks (torchrun, gloo), a tiny GPT with 4 experts at expert parallelism 2 (alltoall
dispatcher, SequentialMLP experts, TP 1, mock data, fp32, no dropout): coc-inject off (not on
PYTHONPATH), and its bootstrap on PYTHONPATH with COC_MOE_OVERLAP=1, as a user runs it. Prints each
iteration's ``lm loss`` of both; exits 0 only if they are equal within 1e-5 relative AND the pieces
ran: every rank's COC_REPORT lists each MoELayer on the pieces (none on Megatron's path), the banner
was logged and no "runs Megatron's path" warning. Without a checkout, tag core_v0.19.0 is extracted
from the Megatron-LM mirror into a temporary directory. Megatron's training loop needs CUDA: the CPU
shims in benchmarks/megatron_lm/cpu_shims.py (applied in both runs by run_pretrain.py) stand in.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WRAPPER = ROOT / "benchmarks" / "megatron_lm" / "run_pretrain.py"
MIRROR = os.environ.get("MEGATRON_LM_MIRROR", "/work/.mirror/NVIDIA+Megatron-LM/repo")
TAG = "core_v0.19.0"
RTOL = 1e-5
BANNER = "MoE overlap installed on MoELayer"
MEGATRON_PATH = "runs Megatron's path"
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.eE+-]+) \|")


def model_args(iters: int) -> list:
    return f"""
    --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
    --seq-length 32 --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4
    --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01
    --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --transformer-impl local
    --train-iters {iters} --eval-iters 0 --eval-interval 1000 --log-interval 1 --seed 1234
    --lr 1e-3 --lr-decay-style constant --weight-decay 0.0 --clip-grad 0.0
    --hidden-dropout 0 --attention-dropout 0 --use-cpu-initialization
    --distributed-backend gloo --no-gradient-accumulation-fusion --no-bias-dropout-fusion
    --no-masked-softmax-fusion --no-bias-gelu-fusion --no-persist-layer-norm --no-rope-fusion
    --mock-data --split 100,0,0 --tokenizer-type NullTokenizer --vocab-size 256
    """.split()
    # --clip-grad 0: clip_grads.py asserts the grads are torch.cuda.FloatTensor.


def checkout_dir(given: str | None, scratch: Path) -> Path:
    if given:
        path = Path(given).resolve()
        if not (path / "pretrain_gpt.py").is_file():
            sys.exit(f"error: {path} is not a Megatron-LM checkout (no pretrain_gpt.py)")
        return path
    if not os.path.isdir(MIRROR):
        sys.exit(f"error: no Megatron-LM checkout given and no mirror at {MIRROR} (set MEGATRON_LM_MIRROR, "
                 "or pass a checkout: git clone https://github.com/NVIDIA/Megatron-LM; "
                 f"git -C Megatron-LM checkout {TAG})")
    path = scratch / "Megatron-LM"
    path.mkdir()
    archive = subprocess.run(["git", "-C", MIRROR, "archive", TAG], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
    print(f"extracted {TAG} from {MIRROR} into {path}")
    return path


def run(name: str, checkout: Path, out: Path, iters: int, coc: bool) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COC_")}
    env["PYTHONPATH"] = os.pathsep.join(([str(ROOT / "sitecustomize")] if coc else []) + [str(checkout)])
    if coc:
        env.update(COC_MOE_OVERLAP="1", COC_REPORT=str(out / f"{name}-report-{{rank}}.json"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(WRAPPER), str(checkout / "pretrain_gpt.py"), *model_args(iters)]
    return run_logged(name, command, env, out, f"PYTHONPATH={env['PYTHONPATH']}" + (" COC_MOE_OVERLAP=1" if coc else ""))


def run_logged(name: str, command: list, env: dict, out: Path, said: str) -> str:
    """``command`` in ``out``, its output in ``out/<name>.log``; the log's text, or exit naming the run."""
    log = out / f"{name}.log"
    print(f"{name}: {said} -> {log}", flush=True)
    with open(log, "w") as file:
        code = subprocess.run(command, env=env, cwd=out, stdout=file, stderr=subprocess.STDOUT, timeout=900).returncode
    text = log.read_text(errors="replace")
    if code != 0:
        print("\n".join(text.splitlines()[-40:]))
        sys.exit(f"error: the {name} run failed (exit {code}); log: {log}")
    return text


def losses(text: str) -> dict:
    return {int(i): float(loss) for i, loss in LOSS.findall(text)}


def pieces_evidence(text: str, out: Path, iters: int) -> list:
    """The problems with the claim that the MoE all-to-alls ran in pieces (empty: they did)."""
    problems = []
    if BANNER not in text:
        problems.append(f"no '{BANNER}' banner in the log")
    problems += [line for line in text.splitlines() if MEGATRON_PATH in line]
    reports = sorted(glob.glob(str(out / "coc-report-*.json")))
    if len(reports) != 2:
        problems.append(f"{len(reports)} COC_REPORT files, not 2")
    for path in reports:
        rows = [row for row in json.load(open(path))["layers"] if row["class"] == "MoELayer"]
        if not rows:
            problems.append(f"{path}: no MoELayer rows")
        for row in rows:
            if row["route"] != "moe" or not row.get("pieces") or row["reason"] or row["calls"] != iters:
                problems.append(f"{path}: {row}")
            else:
                print(f"  {Path(path).name}: {row['name']}: {row['pieces']} pieces ({row['chunks']} per local "
                      f"expert), {row['calls']} calls")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?", help=f"Megatron-LM checkout (default: {TAG} from {MIRROR})")
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--keep", help="write the logs and reports here (default: a temporary directory)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="megatron-lm-moe-") as scratch:
        out = Path(args.keep or scratch).resolve()
        out.mkdir(parents=True, exist_ok=True)
        for stale in glob.glob(str(out / "coc-report-*.json")):
            os.remove(stale)
        checkout = checkout_dir(args.checkout, Path(scratch))
        off_text = run("off", checkout, out, args.iters, coc=False)
        on_text = run("coc", checkout, out, args.iters, coc=True)
        if "[coc-inject" in off_text:
            print("error: coc-inject spoke in the run meant without it")
            return 1
        off, on = losses(off_text), losses(on_text)
        print(f"\n{'iter':>4}  {'lm loss (off)':>14}  {'COC_MOE_OVERLAP=1':>17}  {'abs diff':>9}")
        for i in sorted(off.keys() | on.keys()):
            a, b = off.get(i, float("nan")), on.get(i, float("nan"))
            print(f"{i:>4}  {a:>14.6e}  {b:>17.6e}  {abs(a - b):>9.2e}")
        complete = sorted(off) == sorted(on) == list(range(1, args.iters + 1))
        diffs = [abs(off[i] - on[i]) for i in off if i in on]
        equal = complete and all(abs(off[i] - on[i]) <= RTOL * abs(off[i]) for i in off)
        print(f"max abs difference: {max(diffs, default=float('nan')):.3e} "
              f"({'equal' if equal else 'NOT equal'} within {RTOL:g} relative"
              f"{'' if complete else '; iterations missing'})")
        print("coc-inject's report (COC_MOE_OVERLAP=1 run):")
        problems = pieces_evidence(on_text, out, args.iters)
        print("the MoE all-to-alls ran in pieces" if not problems else
              "the pieces did NOT run as claimed:\n  " + "\n  ".join(problems))
        for line in on_text.splitlines():
            if line.startswith("[coc-inject"):
                print("  " + line)
        return 0 if equal and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
