"""``coc-inject selftest``: every wing on 2 CPU ranks (gloo) against its truth, the JSON read back.
(A wrong kernel making it fail, named: tests/linears/test_fused.py, through the fake ATB kernel.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from coc_inject.selftest import linears
from coc_inject.selftest.multi_copy import AUTOGRAD_CASE, MOE, SEQUENCE
from coc_inject.selftest.run import WINGS


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
