"""The first-step summary without a pass over the heap (issue 52): in a bootstrapped process the coverage
learns the modules as they are built (coverage/tree.py) and names, counts and finds what a pass over every
live object would, without gc.collect() or gc.get_objects() in the step -- unless a counted layer lies
outside the trees of the called ones (it might be garbage) or a tree is headed by a module built before
Megatron's import (its parents unseen): then the heap is collected and walked, as before."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from coc_inject.testbed.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from launch import coc_env  # noqa: E402


def _run(mode: str) -> dict:
    env = dict(coc_env("auto"), COC_MULTI_COPY="auto")
    env["PYTHONPATH"] += f":{ROOT}"
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("coverage_tree_case.py")),
                           str(free_port()), mode], env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("mode", ["model", "standalone", "early wrapper"])
def test_the_first_step_summary_sees_what_the_heap_shows(mode):
    result = _run(mode)
    seen, heap = result["seen"], result["heap"]
    assert seen["tracker"], result
    assert seen["names"] == heap["names"] and seen["local"] == heap["local"], result
    prefix = "chunks." if mode == "early wrapper" else ""
    assert f"{prefix}0.decoder.layers.1.mlp.linear_fc2" in seen["names"], result
    if mode == "model":
        assert seen["walked"] == [] and seen["local"] == 9, result  # 2 layers x 4 linears + the output layer
    else:  # a layer outside the called ones' trees (garbage?), a tree headed by a module built before the tracker
        assert seen["walked"] == ["collect", "get_objects"], result
        assert seen["local"] == (10 if mode == "standalone" else 9), result
