"""Assertions shared by the TP=2 and TP=4 layer suites (run in the test process)."""

FP32_BOUND = 1e-5
BF16_BOUND = 2.0**-7  # one bf16 ulp at the largest magnitude: "within bf16 rounding"

# (layer, sequence parallel, extra compare() options): every case the engine handles.
CASES = [
    ("row", False, {}),
    ("row", True, {}),
    ("column", True, {}),
    ("column", False, {"enable_coc_in_column_backward": True}),
]
CASE_IDS = ["row", "row-sp", "column-sp", "column-bwd"]

# Collectives one call issues: (forward, backward) for Megatron and for CoC with c chunks.
MEGATRON_COUNTS = {
    ("row", False): ({"all_reduce": 1}, {}),
    ("row", True): ({"reduce_scatter_tensor": 1}, {"all_gather_into_tensor": 1}),
    ("column", True): ({"all_gather_into_tensor": 1}, {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}),
    ("column", False): ({}, {"all_reduce": 1}),
}


def coc_counts(kind, sequence_parallel, chunks, recompute_all_gather=True):
    if kind == "row" and not sequence_parallel:
        return {"all_reduce": chunks}, {}
    if kind == "row":
        return {"reduce_scatter_single": chunks}, {"all_gather": chunks}
    if sequence_parallel:
        backward = {"reduce_scatter_single": chunks}
        if recompute_all_gather:
            backward["all_gather_single"] = 1
        return {"all_gather": chunks}, backward
    return {}, {"all_reduce": chunks}


def effective(chunks, rows_per_block):
    return max(1, min(chunks, rows_per_block))


def check_results(results, *, kind, sequence_parallel, chunks, rows_per_block, bound=FP32_BOUND,
                  recompute_all_gather=True, expect_keys=None):
    for rank, result in enumerate(results):
        assert result["coc_calls"] == 1, f"rank {rank}: the CoC path was not taken"
        assert result["shapes_equal"]
        assert result["bitwise_repeat"], f"rank {rank}: two CoC runs of the same call differ"
        if expect_keys is not None:
            assert set(result["keys"]) == set(expect_keys)
        for name, error in result["errors"].items():
            assert error <= bound, f"rank {rank} {name}: relative error {error:.2e} > {bound:.1e}"
        assert result["reference_counts"] == MEGATRON_COUNTS[(kind, sequence_parallel)]
        expected = coc_counts(kind, sequence_parallel, effective(chunks, rows_per_block), recompute_all_gather)
        assert result["coc_counts"] == expected, f"rank {rank}: collectives {result['coc_counts']}"
