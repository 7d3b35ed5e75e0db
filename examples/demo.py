"""`make demo`: run the unmodified examples/tp_mlp.py under torchrun with CoC off, then on.

CoC is switched on only through the environment (bootstrap on PYTHONPATH + COC_PARALLEL_NUM),
exactly as a user would. Prints the banner, the collectives each run issued and the largest
difference of every output and gradient between the two runs.
"""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "tp_mlp.py"
SITE = ROOT / "sitecustomize"
RANKS = 2


def clean_env(**extra):
    """This environment without any CoC settings or PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COC_", "USE_COC_"))}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def launch(workdir, name, env, *script_args, timeout=300):
    """torchrun the example on RANKS CPU ranks; returns (CompletedProcess, per-rank results or None)."""
    out = Path(workdir) / f"{name}.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS),
               "--standalone", str(SCRIPT), "--out", str(out), *script_args]
    proc = subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return proc, None
    return proc, [torch.load(Path(workdir) / f"{name}_rank{rank}.pt") for rank in range(RANKS)]


def main(chunks: int = 4) -> int:
    with tempfile.TemporaryDirectory() as workdir:
        runs = {}
        for label, env in (("CoC off", clean_env()),
                           (f"CoC on (COC_PARALLEL_NUM={chunks})",
                            clean_env(PYTHONPATH=str(SITE), COC_PARALLEL_NUM=str(chunks)))):
            print(f"== {label}: torchrun --nproc-per-node {RANKS} examples/tp_mlp.py", flush=True)
            proc, results = launch(workdir, label.split()[1].strip("(,"), env)
            if results is None:
                print(proc.stderr[-4000:], file=sys.stderr)
                return 1
            for line in proc.stderr.splitlines():
                if line.startswith("[coc-inject"):
                    print("   ", line)
            print(f"    rank 0 collectives: forward {results[0]['forward_collectives']}, "
                  f"backward {results[0]['backward_collectives']}")
            if "all_gather" in results[0]["forward_collectives"]:
                print("    (all_reduce: one per chunk of the Row layer; all_gather: the one-time "
                      "cross-rank config check)")
            runs[label] = results
        off, on = runs.values()
        print("== max |difference| CoC on vs off (fp32)")
        worst = 0.0
        for key in off[0]:
            if torch.is_tensor(off[0][key]):
                delta = max((on[r][key] - off[r][key]).abs().max().item() for r in range(RANKS))
                worst = max(worst, delta)
                print(f"    {key:<18} {delta:.3e}")
        print(f"== {'EQUAL' if worst <= 1e-5 else 'DIFFERENT'} within 1e-5 (worst {worst:.3e})")
        return 0 if worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
