"""coc-inject bench --cases moe: its arithmetic (pure) and one small real run on 2 local ranks."""

import json
import subprocess
import sys

import pytest

from coc_inject.bench.cases import moe


def samples(ms: dict, reps=3) -> dict:
    return {name: [t / 1e3] * reps for name, t in ms.items()}


def test_limit_is_the_larger_of_compute_and_exposed_communication():
    # C = 60, Megatron 160 -> M = 100, limit 100: pieces at 125 ms reach 80% of it and hide 35% of M.
    case = moe.summarize(2, 2, 2, samples({"megatron": 160, "pieces c=1": 140, "pieces c=2": 125, "pieces c=4": 130,
                                           "auto": 125, "compute-only": 60}), 2)
    assert (case["compute_ms"], case["comm_ms"], case["limit_ms"]) == pytest.approx((60, 100, 100))
    c2 = case["rows"]["pieces c=2"]
    assert c2["of_limit"] == pytest.approx(0.8) and c2["hidden"] == pytest.approx(0.35)
    assert c2["vs_megatron"] == pytest.approx(160 / 125)
    assert case["best_fixed"] == "pieces c=2" and case["auto_vs_best"] == pytest.approx(1.0)
    assert "80.0% of limit" in moe.format_table([case])


def test_ratios_are_medians_of_per_repetition_ratios():
    data = samples({"megatron": 100, "pieces c=1": 50, "pieces c=2": 50, "pieces c=4": 50, "auto": 50,
                    "compute-only": 10})
    data["megatron"], data["pieces c=1"] = [0.1, 0.3, 0.1], [0.05, 0.1, 0.2]  # ratios 2, 3, 0.5
    assert moe.summarize(2, 2, 2, data, 1)["rows"]["pieces c=1"]["vs_megatron"] == pytest.approx(2.0)


def test_a_small_run_writes_every_variant_and_auto_decides(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "bench", "--cases", "moe", "--reps", "1",
                           "--local-experts", "1", "2", "--moe-tokens", "64", "--moe-hidden", "32", "--moe-ffn", "32",
                           "--startup-reps", "0", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "moe.json").read_text())
    assert [case["local_experts"] for case in result["cases"]] == [1, 2]
    for case in result["cases"]:
        assert list(case["rows"]) == ["megatron", "pieces c=1", "pieces c=2", "pieces c=4", "pieces c=8", "auto"]
        assert case["auto_chunks"] in ("megatron", 1, 2, 4, 8)
        assert all(row["ms"] > 0 for row in case["rows"].values())
    assert "EP2, 2 local experts, top-2" in proc.stdout
