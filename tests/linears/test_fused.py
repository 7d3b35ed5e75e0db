"""USE_COC_FUSED_KERNEL=1 through the full Megatron path, on a FAKE torch_atb (tests/fakes) that
checks the ATB lcoc call contract and computes with gloo. Real Ascend hardware: not verified."""

import pytest

from layer_checks import BF16_BOUND, CASE_IDS, CASES

# The fused kernel calls one call of each layer makes (forward, and Row SP's backward), as
# (ATB type, trans_weight, keep_intermediate); compare() runs the CoC call twice.
EXPECTED_KERNELS = {
    ("row", False): [("LINEAR_ALL_REDUCE", True, False)],
    ("row", True): [("LINEAR_REDUCE_SCATTER", True, False), ("ALL_GATHER_LINEAR", False, True)],
    ("column", True): [("ALL_GATHER_LINEAR", True, True)],
    ("column", False): [],  # no communication in that forward; its backward is chunked
}


def fixed_backward_count(kind, sp):
    """Column without SP has no fused forward; its chunked backward needs a count. Without
    COC_PARALLEL_NUM it would be tuned (auto, see test_fused_request_without_a_kernel_tunes)."""
    return {"config_options": {"parallel_num": 4}} if (kind, sp) == ("column", False) else {}


def check_fused(results, kind, sp):
    for rank, result in enumerate(results):
        assert result["coc_calls"] == 1
        assert result["bitwise_repeat"]
        for name, error in result["errors"].items():
            assert error <= BF16_BOUND, f"rank {rank} {name}: {error:.2e}"
        kernels = [call[:3] for call in result["fake"]["calls"]]
        assert sorted(kernels) == sorted(EXPECTED_KERNELS[(kind, sp)] * 2), kernels


@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
def test_fused_megatron_path_tp2(pool2, kind, sp, options):
    results = pool2.run("fused_cases:compare_fused", kind=kind, sequence_parallel=sp, seq=14,
                        **fixed_backward_count(kind, sp))
    check_fused(results, kind, sp)
    if kind == "row" and not sp:
        assert "matmul_all_reduce: fused kernel atb" in results[0]["log"]


@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
def test_fused_megatron_path_tp4(pool4, kind, sp, options):
    check_fused(pool4.run("fused_cases:compare_fused", kind=kind, sequence_parallel=sp, seq=12, batch=1,
                          **fixed_backward_count(kind, sp)), kind, sp)


def test_deterministic_mode_reaches_the_kernel(pool2):
    results = pool2.run("fused_cases:compare_fused", kind="row", sequence_parallel=True, seq=14,
                        config_options={"deterministic": True})
    check_fused(results, "row", True)
    assert results[0]["fake"]["created"] and set(results[0]["fake"]["created"]) == {"1"}


@pytest.mark.parametrize("fake,dtype,fragment", [
    (False, "bfloat16", "atb: torch_atb is not installed"),
    (True, "float32", "ATB lcoc takes fp16 or bf16"),
])
def test_outside_the_backend_says_why_and_runs_chunked(pool2, fake, dtype, fragment):
    results = pool2.run("fused_cases:compare_fused", kind="row", sequence_parallel=False, seq=14,
                        dtype=dtype, fake=fake, config_options={"parallel_num": 4})
    bound = BF16_BOUND if dtype == "bfloat16" else 1e-5
    for result in results:
        assert result["coc_calls"] == 1 and max(result["errors"].values()) <= bound
        assert result["coc_counts"][0] == {"all_reduce": 4}  # the chunked pipeline ran instead
        assert result["log"].count("no fused backend can run it") == 1 and fragment in result["log"]
        if fake:
            assert result["fake"]["calls"] == []


def test_fused_request_without_a_kernel_tunes(pool2):
    # USE_COC_FUSED_KERNEL=1 alone, no kernel for the call: the chunked pipeline's count is auto.
    results = pool2.run("fused_cases:compare_fused", kind="row", sequence_parallel=False, seq=14, fake=False)
    decisions = [line for line in results[0]["log"].splitlines() if line.startswith("auto: row [28, 64, 64]")]
    assert len(decisions) == 1, results[0]["log"]
    assert "using the chunked pipeline with auto-tuned chunks" in results[0]["log"]
    for result in results:
        assert max(result["errors"].values()) <= BF16_BOUND
        assert result["log"].count("auto: row [28, 64, 64]") == len(decisions)  # rank 1 logs at debug


def test_pinned_chunked_never_uses_the_kernel(pool2):
    for result in pool2.run("fused_cases:compare_fused", kind="column", sequence_parallel=True, seq=14,
                            config_options={"fused_backend": "chunked"}):
        assert result["fake"]["calls"] == [] and "COC_FUSED_BACKEND=chunked" in result["log"]
        assert max(result["errors"].values()) <= BF16_BOUND


def test_non_power_of_two_tp_falls_back(pool3):
    for result in pool3.run("fused_cases:compare_fused", kind="row", sequence_parallel=True, seq=12,
                            hidden=48, ffn=96):
        assert "tensor-parallel size 3 is not a power of 2" in result["log"]
        assert result["fake"]["calls"] == []
        assert max(result["errors"].values()) <= BF16_BOUND


def test_fake_enforces_the_atb_contract(pool2):
    refused = pool2.run("fused_cases:fake_rejects")[0]
    assert all(message for message in refused.values()), refused
    assert "only 'lcoc'" in refused["hccl backend"]
    assert "trans_weight must be set explicitly" in refused["trans_weight not set"]
    assert "not a power of 2" in refused["rank_size 3"]
    assert "fp16/fp16 or bf16/bf16" in refused["fp32"]


def _selftest_with_fakes(tmp_path, **environ):
    import json
    import os
    import subprocess
    import sys

    from fused_cases import FAKES

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([FAKES, os.environ.get("PYTHONPATH", "")]), **environ)
    proc = subprocess.run([sys.executable, "-m", "coc_inject", "selftest", "--cases", "linears", "--dtype", "bfloat16",
                           "--reps", "1", "--chunks", "2", "--shape", "64", "32", "48", "--json",
                           str(tmp_path / "st.json")], env=env, capture_output=True, text=True, timeout=300)
    return proc, json.loads((tmp_path / "st.json").read_text())


def test_selftest_runs_the_fused_backend_it_finds(tmp_path):
    proc, result = _selftest_with_fakes(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    fused = {r["case"]: r["error"] for r in result["cases"] if r["backend"] == "fused atb"}
    assert set(fused) == {"matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul"}
    assert all(error <= 2.0**-6 for error in fused.values())


def test_selftest_fails_and_names_a_wrong_fused_kernel(tmp_path):
    # The fake ATB kernel's reduce-scatter is made 5% wrong: the self-test must exit 1 and name that case only.
    proc, result = _selftest_with_fakes(tmp_path, FAKE_ATB_WRONG="LINEAR_REDUCE_SCATTER")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert result["passed"] is False
    *named, summary = [line for line in proc.stdout.splitlines() if line.startswith("FAIL: ")]
    assert result["failures"] == [line.removeprefix("FAIL: ") for line in named]
    assert summary.startswith("FAIL: 6 of 7 cases within their bounds")
    assert len(result["failures"]) == 1 and result["failures"][0].startswith(
        "linears matmul_reduce_scatter [fused atb, bfloat16]: output ")
    wrong = [r for r in result["cases"] if "skipped" not in r and not r["passed"]]
    assert [(r["case"], r["backend"]) for r in wrong] == [("matmul_reduce_scatter", "fused atb")]
    assert wrong[0]["error"] > 2.0**-6


# MC2 (torch_npu) pinned with COC_FUSED_BACKEND=mc2; k >= 256 as MC2 requires.
EXPECTED_MC2 = {
    ("row", False): ["npu_mm_all_reduce_base"],
    ("row", True): ["npu_mm_reduce_scatter_base", "npu_all_gather_base_mm"],
    ("column", True): ["npu_all_gather_base_mm"],
    ("column", False): [],
}


@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
def test_mc2_megatron_path_tp2(pool2, kind, sp, options):
    results = pool2.run("fused_cases:compare_fused", kind=kind, sequence_parallel=sp, seq=14, hidden=256,
                        ffn=512, config_options={"fused_backend": "mc2",
                                                 **fixed_backward_count(kind, sp).get("config_options", {})})
    for result in results:
        assert result["coc_calls"] == 1 and max(result["errors"].values()) <= BF16_BOUND, result["errors"]
        assert result["fake"]["calls"] == []  # ATB never consulted when mc2 is pinned
        assert sorted(call[0] for call in result["fake"]["mc2"]) == sorted(EXPECTED_MC2[(kind, sp)] * 2)


def test_mc2_odd_k_falls_back_with_the_reason(pool2):
    # Row k = ffn / TP = 64 < 256: outside MC2's k range.
    for result in pool2.run("fused_cases:compare_fused", kind="row", sequence_parallel=False, seq=14,
                            config_options={"fused_backend": "mc2"}):
        assert "k=64 is outside MC2's range [256, 65535)" in result["log"]
        assert result["fake"]["mc2"] == [] and max(result["errors"].values()) <= BF16_BOUND


@pytest.mark.parametrize("backend", ["atb", "mc2"])
@pytest.mark.parametrize("op", ["matmul_all_reduce", "matmul_reduce_scatter", "all_gather_matmul"])
def test_public_ops_through_fused_backends(pool2, backend, op):
    rows = 14 if op == "matmul_reduce_scatter" else 13
    for result in pool2.run("fused_cases:ops_through", backend=backend, check="check_op", op=op, chunks=3,
                            rows=rows, k=256, n=48, dtype="bfloat16"):
        fake = result.pop("fake")
        assert max(result.values()) <= BF16_BOUND, result
        used = fake["calls"] if backend == "atb" else fake["mc2"]
        assert used, "the fused kernel was not called"


@pytest.mark.parametrize("granularity", ["tensor", "channel", "group"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_w8a16_through_mc2(pool2, granularity, dtype):
    for result in pool2.run("fused_cases:ops_through", backend="mc2", check="check_w8a16",
                            granularity=granularity, dtype=dtype, k=320, group_size=64):
        assert result["error"] <= (2.0**-6 if dtype == "bfloat16" else 2.0**-9), result
        assert [call[4] for call in result["fake"]["mc2"]] == ["torch.int8"]  # one fused int8 call


# CUDA symmetric memory through fake CPU kernels (tests/fakes/symm_mem_cpu.py), pinned.
EXPECTED_SYMM_MEM = {
    ("row", True): ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"],
    ("column", True): ["fused_all_gather_matmul"],
}


@pytest.mark.parametrize("kind,sp", [("row", True), ("column", True)], ids=["row-sp", "column-sp"])
def test_symm_mem_megatron_path_tp2(pool2, kind, sp):
    for result in pool2.run("fused_cases:compare_fused", kind=kind, sequence_parallel=sp, seq=14, symm_mem=True,
                            config_options={"fused_backend": "symm_mem"}):
        assert result["coc_calls"] == 1 and max(result["errors"].values()) <= BF16_BOUND, result["errors"]
        assert sorted(call[0] for call in result["fake"]["symm_mem"]) == sorted(EXPECTED_SYMM_MEM[(kind, sp)] * 2)


def test_symm_mem_has_no_matmul_all_reduce(pool2):
    for result in pool2.run("fused_cases:compare_fused", kind="row", sequence_parallel=False, seq=14,
                            symm_mem=True, config_options={"fused_backend": "symm_mem"}):
        assert "CUDA symmetric memory has no fused matmul_all_reduce" in result["log"]
        assert result["fake"]["symm_mem"] == [] and max(result["errors"].values()) <= BF16_BOUND


def test_symm_mem_without_a_device_kernel_says_cuda_only(pool2):
    for result in pool2.run("fused_cases:compare_fused", kind="column", sequence_parallel=True, seq=14,
                            config_options={"fused_backend": "symm_mem"}):
        assert "symm_mem: no CUDA device (the symm_mem fused kernels are CUDA only)" in result["log"]
        assert max(result["errors"].values()) <= BF16_BOUND


@pytest.mark.parametrize("op", ["matmul_reduce_scatter", "all_gather_matmul"])
def test_public_ops_through_symm_mem(pool2, op):
    rows = 14 if op == "matmul_reduce_scatter" else 13
    for result in pool2.run("fused_cases:ops_through", backend="symm_mem", check="check_op", op=op, chunks=3,
                            rows=rows, k=64, n=48, dtype="bfloat16"):
        fake = result.pop("fake")
        assert max(result.values()) <= BF16_BOUND, result
        assert fake["symm_mem"], "the fused kernel was not called"


def test_customized_minus_one_fuses_only_that_shape(pool2):
    # Row forward shape [m, k, n] = [seq*batch, ffn/TP, hidden] = [28, 64, 64]: fused; others chunked.
    results = pool2.run("fused_cases:compare_fused", kind="row", sequence_parallel=False, seq=14,
                        config_options={"fused": False, "parallel_num": 3, "customized_coc": {(28, 64, 64): -1}})
    check_fused(results, "row", False)
    other = pool2.run("fused_cases:compare_fused", kind="row", sequence_parallel=False, seq=13,
                      config_options={"fused": False, "parallel_num": 3, "customized_coc": {(28, 64, 64): -1}})
    for result in other:
        assert result["fake"]["calls"] == [] and result["coc_counts"][0] == {"all_reduce": 3}
