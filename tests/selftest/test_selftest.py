"""``coc-inject selftest``: every wing on 2 CPU ranks (gloo) against its truth, the JSON read back.
(A wrong kernel making it fail, named: tests/linears/test_fused.py, through the fake ATB kernel.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from coc_inject.selftest import linears
from coc_inject.selftest.multi_copy import AUTOGRAD_CASE, MOE, SEQUENCE
from coc_inject.selftest.run import WINGS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    path = tmp_path_factory.mktemp("selftest") / "selftest.json"
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "selftest", "--reps", "1", "--json", str(path)],
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads(path.read_text()) if path.exists() else None


def checked(result, wing):
    return [r for r in result["cases"] if r["wing"] == wing and "skipped" not in r]


def test_every_wing_passes_and_the_json_says_so(selftest):
    proc, result = selftest
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["passed"] is True and result["failures"] == [] and result["wings"] == list(WINGS)
    for wing in WINGS:
        rows = checked(result, wing)
        assert rows, f"{wing}: no case ran"
        assert all(r["passed"] and r["error"] <= r["bound"] for r in rows), rows
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith(f"PASS: {sum('skipped' not in r for r in result['cases'])} of ")
    assert lines[-1].endswith(f"every wing checked ({', '.join(WINGS)})")
    # A progress line as each case starts (the linears: one per op, its backends under it).
    others = [r for r in result["cases"] if r["wing"] != "linears" and "skipped" not in r]
    assert proc.stderr.count("[selftest] ") == len(others) + len(linears.CASES)


def test_the_json_names_what_ran_where(selftest):
    import torch

    from coc_inject import megatron_version

    _, result = selftest
    assert result["device"] == "cpu" and result["dtype"] == "float32" and "2 local CPU ranks" in result["where"]
    versions = result["versions"]
    assert versions["torch"] == torch.__version__ and versions["torch_npu"] is None
    # megatron-core 0.19's version appends `git rev-parse HEAD` of whatever repository holds its files
    # (here: this checkout's .venv), read at each import: compare the release.
    assert versions["megatron_core"].split("+")[0] == megatron_version.importable().version.split("+")[0]


def test_attention_kernels_cover_dtypes_masks_layouts_and_head_dims(selftest):
    _, result = selftest
    rows = checked(result, "attention-kernels")
    assert {(r["dtype"], r["case"]) for r in rows} == {
        (dtype, f"{mask} {layout} d{d}") for dtype in ("float32", "bfloat16", "float16")
        for mask in ("causal", "full") for layout in ("mha", "gqa") for d in (64, 128)}
    assert all(set(r["errors"]) == {"out", "lse", "dq", "dk", "dv"} for r in rows)
    assert {r["backend"] for r in rows} == {"cpu-flash"}  # this device's fused kernel, not the reference
    assert all(r["coc_ms"] > 0 and r["reference_ms"] > 0 for r in rows)


def test_context_parallel_runs_each_algorithm_cp2_has_with_memory_per_rank(selftest):
    _, result = selftest
    rows = checked(result, "context-parallel")
    assert sorted(r["case"].split()[0] for r in rows) == ["allgather", "ring", "ulysses"]
    assert all(set(r["errors"]) == {"out", "dq", "dk", "dv"} and len(r["peak_mb"]) == 2
               and min(r["peak_mb"]) > 0 for r in rows)
    assert any("CP >= 4" in r.get("skipped", "") for r in result["cases"] if r["wing"] == "context-parallel")


def test_multi_copy_and_moe_check_order_and_pieces(selftest):
    _, result = selftest
    autograd, copies, sequence, moe_copies = checked(result, "multi-copy")
    assert autograd["case"] == AUTOGRAD_CASE and autograd["errors"] == {"autograd order": 0.0}
    # batch copies at micro-batch 2, sequence copies at micro-batch 1, batch copies through MoE layers (aux_loss)
    for row in (copies, sequence, moe_copies):
        assert row["errors"]["collective order"] == 0.0 and row["errors"]["copies ran"] == 0.0, row
        assert row["collectives"] > 0 and "why_not_copies" not in row, row
        assert set(row["errors"]) == {"output", "input grad", "param grads", "collective order", "copies ran"}
        assert row["passed"] and row["bound"] == 1e-4, row
    assert sequence["backend"] == f"2 copies, {SEQUENCE}" and sequence["case"] == copies["case"]
    assert moe_copies["backend"] == f"2 copies, {MOE}" and moe_copies["case"] == "MoE block x2 TP=2 SP EP=2"
    # the MoE block's all-to-alls are among its collectives (its copies met in the MoE layers)
    assert moe_copies["collectives"] > copies["collectives"], (moe_copies, copies)
    (moe,) = checked(result, "moe")
    assert moe["errors"]["pieces ran"] == 0.0


def test_an_unknown_wing_is_refused_with_the_allowed_names():
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "selftest", "--cases", "linears,attention"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--cases 'linears,attention': expected a comma-separated list of " + ", ".join(WINGS) in proc.stderr


def test_the_verdict_names_a_wing_not_checked_and_exits_apart_from_pass():
    """#54: without megatron-core the multi-copy and MoE cases cannot run; the verdict said 'PASS' and exit 0
    as if every wing had been checked. Now it names them and exits 3 (PASS, exit 0: every wing checked)."""
    from coc_inject.selftest import common
    from coc_inject.selftest.run import FAILED, PASSED, PASSED_WHAT_RAN, verdict

    ran = common.row("linears", "row", "chunked", {"out": 0.0}, "float32")
    no_megatron = common.skipped("moe", "pieces", "-", "megatron-core is not importable (x)", missing="megatron-core")
    partly = [common.row("multi-copy", AUTOGRAD_CASE, "torch", {"order": 0.0}, "float32", bound=0.0),
              common.skipped("multi-copy", "block", "2 copies", "megatron-core is not importable (x)",
                             missing="megatron-core")]
    device = common.skipped("linears", "row", "fused atb", "torch_npu is not installed")  # the wing ran otherwise
    line, status = verdict([ran, device], ["linears"])
    assert status == PASSED and line.startswith("PASS: 1 of 1 cases within their bounds, 1 not run here")
    line, status = verdict([ran, *partly, no_megatron], ["linears", "multi-copy", "moe"])
    assert status == PASSED_WHAT_RAN != PASSED
    assert line.startswith("PASSED WHAT RAN (exit 3): 2 of 2 cases within their bounds, 2 not run here")
    assert line.endswith("NOT CHECKED: moe (1 of 1 cases), multi-copy (1 of 2 cases): megatron-core is not importable")
    one_rank = common.skipped("linears", "row", "chunked", "one rank: no collective to overlap")
    line, status = verdict([one_rank, ran | {"wing": "meter"}], ["linears", "meter"])
    assert status == PASSED_WHAT_RAN and line.endswith("NOT CHECKED: linears (1 of 1 cases): one rank")
    line, status = verdict([ran | {"passed": False, "errors": {"out": 1.0}}, no_megatron], ["linears", "moe"])
    assert status == FAILED and line.startswith("FAIL: 0 of 1") and "NOT CHECKED: moe" in line


def test_without_megatron_core_the_selftest_does_not_claim_every_wing(tmp_path):
    """The command itself, megatron-core made unimportable: the last line names MoE, the exit status is 3."""
    blocker = tmp_path / "megatron"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('megatron-core blocked by the test')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "selftest", "--cases", "moe", "--reps", "1"],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 3, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("PASSED WHAT RAN (exit 3): 0 of 0 cases")
    assert last.endswith("NOT CHECKED: moe (1 of 1 cases): megatron-core is not importable"), last
