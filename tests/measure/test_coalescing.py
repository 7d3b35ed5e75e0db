"""Megatron DDP's gradient buckets go out through torch's ``_coalescing_manager``: the collectives inside
are queued and sent at its exit, which waits for them (``async_ops`` false) or leaves that to
``cm.wait()``. The meter must time those waits (a real gloo group of one rank, in a child process)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, sys, time, torch, torch.distributed as dist
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from coc_inject import job
    from coc_inject.config import CocConfig
    from coc_inject.measure import install
    original = dist._coalescing_manager
    exposure = install.install(CocConfig(measure=(1, None)))
    tensors = [torch.ones(1 << 16) for _ in range(4)]
    with dist._coalescing_manager(async_ops=False):
        for t in tensors:
            dist.all_reduce(t)
    exposure.end_step()
    with dist._coalescing_manager(async_ops=True) as cm:
        for t in tensors:
            dist.all_reduce(t, async_op=True)
    cm.wait()
    exposure.end_step()
    job.uninstall()
    rows = [row["total"] for row in exposure.per_step]
    waits = [sum(t.sum().item() for t in tensors)]
    json.dump({"rows": rows, "restored": dist._coalescing_manager is original, "sums": waits}, sys.stdout)
""")


def test_a_coalesced_batch_is_counted_and_its_wait_timed():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["restored"]
    assert result["sums"] == [4 * (1 << 16)]  # the collectives still ran (a world of one: the sum is the tensor)
    for row in result["rows"]:  # both batches: 4 collectives, each with its bytes, the batch's wait timed
        assert row["collectives"] == 4 and row["bytes"] == 4 * 4 * (1 << 16)
        assert row["exposed_s"] > 0 and row["communication_s"] >= row["exposed_s"] * 0.999
