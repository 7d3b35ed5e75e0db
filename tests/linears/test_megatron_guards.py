"""Guards for megatron-core features the CoC forwards would otherwise get wrong (issue 8).

Each test builds the real layer with the feature on, on a release that has it, and compares
coc-inject against unpatched Megatron. Each would fail without its guard: the call would go
through CoC (wrong numbers, a crash, or a missing reason) instead of Megatron's path, or CoC
would ignore the feature.
"""

import pytest

from coc_inject.megatron_version import importable, release
from dist_harness import RankPool

VERSION = importable().version
MEGATRON = release(VERSION)


def needs(since):
    return pytest.mark.skipif(MEGATRON < since, reason=f"megatron-core {VERSION} predates the feature")


@pytest.fixture(scope="module")
def pool4_gtp():
    pool = RankPool(4)  # TP 4 at start; the GTP case re-initialises TP 2 x weight shards 2 and back
    yield pool
    pool.close()


@needs((0, 19))
@pytest.mark.parametrize("kind,sp", [("row", False), ("row", True), ("column", True)],
                         ids=["row", "row-sp", "column-sp"])
def test_tensor_parallel_weight_sharding_goes_to_megatron(pool4_gtp, kind, sp):
    for result in pool4_gtp.run("guard_cases:weight_sharding", kind=kind, sequence_parallel=sp):
        assert result["gtp_remat_size"] == 2
        assert result["calls"] == 0, "CoC multiplied by a weight shard"
        assert result["bitwise_equal"], result["errors"]
        assert set(result["keys"]) == {"output", "input_grad", "main_grad"}
        assert result["log"].count("tensor-parallel weight sharding (gtp_remat_size=2)") == 1


@pytest.mark.parametrize("kind,sp", [("row", False), ("row", True), ("column", True), ("column", False)],
                         ids=["row", "row-sp", "column-sp", "column-bwd"])
def test_weight_of_another_shape_goes_to_megatron(pool2, kind, sp):
    for result in pool2.run("guard_cases:resized_weight", kind=kind, sequence_parallel=sp):
        assert result["calls"] == 0
        assert result["bitwise_equal"], result["errors"]
        assert result["log"].count("is not the [") == 1


def test_output_dtype_unlike_the_input_goes_to_megatron(pool2):
    for result in pool2.run("guard_cases:output_dtype", dtype="float32"):
        assert result["calls"] == 0
        assert result["bitwise_equal"]
        assert result["log"].count("output_dtype torch.float32 differs from the input dtype torch.bfloat16") == 1


def test_output_dtype_equal_to_the_input_runs_coc(pool2):
    for result in pool2.run("guard_cases:output_dtype", dtype="bfloat16"):
        assert result["calls"] == 2
        assert max(result["errors"].values()) <= 2.0**-7


@needs((0, 18))
def test_inference_optimized_gather_is_used_by_coc_in_eval(pool2):
    for result in pool2.run("guard_cases:inference_gather", training=False):
        assert result["has_feature"] is True
        assert result["calls"] == 1, "CoC did not run the call"
        assert result["inference_gathers"] == 2, "Megatron's inference all-gather was not used by CoC"
        assert result["errors"]["output"] <= 1e-6


@needs((0, 18))
def test_inference_optimized_gather_is_not_used_in_training(pool2):
    for result in pool2.run("guard_cases:inference_gather", training=True):
        assert result["calls"] == 1
        assert result["inference_gathers"] == 0
        assert max(result["errors"].values()) <= 1e-5


@needs((0, 14))
@pytest.mark.parametrize("kind,sp", [("row", False), ("row", True), ("column", True)],
                         ids=["row", "row-sp", "column-sp"])
def test_fsdp_parameter_main_grad_written_like_megatron(pool2, kind, sp):
    for result in pool2.run("guard_cases:fsdp_main_grad", kind=kind, sequence_parallel=sp):
        assert result["calls"] == 1
        assert result["buffers_handed_out"] == 2  # one get_main_grad() per backward, each run
        assert result["grad_added_to_main_grad"] is True
        assert result["errors"]["main_grad"] <= 1e-5, "wgrad did not land in get_main_grad()"
        assert max(result["errors"].values()) <= 1e-5
