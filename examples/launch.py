"""Launch an example under torchrun the way a user would: CoC only through the environment.

``torchrun(...)`` runs ``RANKS`` local CPU ranks with ``--standalone``. With ``link`` (a
:class:`coc_inject.testbed.link.EmulatedLink`) it instead starts one single-rank torchrun per
network namespace, like a two-node job (``--nnodes 2 --node-rank r``), each pinned to its own
core and talking over the rate-limited veth pair.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / "sitecustomize"
RANKS = 2


def clean_env(**extra):
    """This environment without any CoC settings or PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COC_", "USE_COC_"))}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


def coc_env(chunks: int, **extra):
    """Environment with the bootstrap on PYTHONPATH and ``COC_PARALLEL_NUM=chunks``."""
    return clean_env(PYTHONPATH=str(SITE), COC_PARALLEL_NUM=str(chunks), **extra)


def torchrun(script, script_args, env, workdir, link=None, timeout=600, ranks=RANKS) -> subprocess.CompletedProcess:
    run = [sys.executable, "-m", "torch.distributed.run"]
    if link is None:
        command = [*run, "--nproc-per-node", str(ranks), "--standalone", str(script), *script_args]
        return subprocess.run(command, env=env, cwd=workdir, capture_output=True, text=True, timeout=timeout)
    env = dict(env, GLOO_SOCKET_IFNAME="cocl", OMP_NUM_THREADS="1")
    procs = []
    for rank in range(RANKS):
        command = ["ip", "netns", "exec", link.namespace(rank), "taskset", "-c", str(rank % os.cpu_count()),
                   *run, "--nnodes", str(RANKS), "--node-rank", str(rank), "--nproc-per-node", "1",
                   "--master-addr", link.address(0), "--master-port", "29533", str(script), *script_args]
        procs.append(subprocess.Popen(command, env=env, cwd=workdir, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = [proc.communicate(timeout=timeout) for proc in procs]
    code = next((proc.returncode for proc in procs if proc.returncode), 0)
    return subprocess.CompletedProcess(procs[0].args, code, outputs[0][0],
                                       "".join(err for _, err in outputs))
