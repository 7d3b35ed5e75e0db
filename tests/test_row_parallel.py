"""RowParallelLinear without sequence parallelism, 2 real gloo ranks, real megatron-core."""

import pytest

FP32_BOUND = 1e-5


@pytest.mark.parametrize("chunks", [2, 3, 4, 8])
@pytest.mark.parametrize("seq", [16, 13])  # 13*2 = 26 rows: not divisible by 3, 4 or 8
def test_row_all_reduce_matches_unpatched(pool2, chunks, seq):
    results = pool2.run("layer_cases:compare", kind="row", chunks=chunks, seq=seq)
    for rank, result in enumerate(results):
        assert result["coc_calls"] == 1, f"rank {rank}: the CoC path was not taken"
        assert set(result["keys"]) == {"output", "input_grad", "weight_grad", "bias_grad"}
        assert result["shapes_equal"]
        assert result["bitwise_repeat"], "two CoC runs of the same call differ"
        for name, error in result["errors"].items():
            assert error <= FP32_BOUND, f"rank {rank} {name}: relative error {error:.2e}"
        ref_fwd, _ = result["reference_counts"]
        coc_fwd, coc_bwd = result["coc_counts"]
        assert ref_fwd == {"all_reduce": 1}
        assert coc_fwd == {"all_reduce": min(chunks, seq * 2)}  # one all-reduce per chunk
        assert coc_bwd == {}  # Row backward is local
