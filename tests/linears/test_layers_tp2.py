"""Every CoC case against unpatched megatron-core layers: 2 real gloo ranks (TP=2).

Rows m = seq*batch; under SP each rank owns B = m/TP rows, which the chunks split.
seq=14, batch=2 gives B=14 (SP) / m=28 (no SP): divisible by neither 3, 4 nor 8.
"""

import pytest

from layer_checks import BF16_BOUND, CASE_IDS, CASES, check_results, coc_counts
from scope import newest_only

TP = 2


def rows_per_block(sequence_parallel, seq, batch=2):
    return seq * batch // TP if sequence_parallel else seq * batch


@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("chunks", [2, 3, 4, 8])
@pytest.mark.parametrize("seq", [16, 14])
def test_fp32_matches_unpatched(pool2, kind, sp, options, chunks, seq):
    results = pool2.run("layer_cases:compare", kind=kind, chunks=chunks, sequence_parallel=sp, seq=seq, **options)
    check_results(results, kind=kind, sequence_parallel=sp, chunks=chunks,
                  rows_per_block=rows_per_block(sp, seq),
                  expect_keys={"output", "input_grad", "weight_grad", "bias_grad"})


@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("bias,skip_bias_add", [(False, False), (True, True)], ids=["no-bias", "skip-bias-add"])
def test_bias_variants(pool2, kind, sp, options, bias, skip_bias_add):
    results = pool2.run("layer_cases:compare", kind=kind, chunks=3, sequence_parallel=sp, seq=14,
                        bias=bias, skip_bias_add=skip_bias_add, **options)
    keys = {"output", "input_grad", "weight_grad"} | ({"bias_grad"} if bias else set())
    check_results(results, kind=kind, sequence_parallel=sp, chunks=3,
                  rows_per_block=rows_per_block(sp, 14), expect_keys=keys)


@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("chunks", [2, 4])
def test_bf16_within_bf16_rounding(pool2, kind, sp, options, chunks):
    results = pool2.run("layer_cases:compare", kind=kind, chunks=chunks, sequence_parallel=sp, seq=16,
                        dtype="bfloat16", hidden=64, ffn=128, **options)
    check_results(results, kind=kind, sequence_parallel=sp, chunks=chunks,
                  rows_per_block=rows_per_block(sp, 16), bound=BF16_BOUND)


def test_column_sp_keeps_gathered_input_without_recompute(pool2):
    results = pool2.run("layer_cases:compare", kind="column", chunks=4, sequence_parallel=True, seq=14,
                        recompute_all_gather=False)
    # No input re-gather in backward: one all-gather fewer than with recompute.
    check_results(results, kind="column", sequence_parallel=True, chunks=4,
                  rows_per_block=rows_per_block(True, 14), recompute_all_gather=False)


@pytest.mark.parametrize("gather", [{"layer_options": {"gather_output": True}},
                                    {"forward_kwargs": {"runtime_gather_output": True}}],
                         ids=["gather_output", "runtime_gather_output"])
def test_column_gather_output(pool2, gather):
    results = pool2.run("layer_cases:compare", kind="column", chunks=3, sequence_parallel=False, seq=14,
                        enable_coc_in_column_backward=True, **gather)
    for result in results:
        assert result["coc_calls"] == 1
        assert max(result["errors"].values()) <= 1e-5
        assert result["coc_counts"][0] == {"all_gather_into_tensor": 1}  # the output gather


def test_row_scatters_a_non_parallel_input(pool2):
    results = pool2.run("layer_cases:compare", kind="row", chunks=3, seq=14,
                        layer_options={"input_is_parallel": False})
    for result in results:
        assert result["coc_calls"] == 1 and max(result["errors"].values()) <= 1e-5
        # Megatron's scatter of the input is kept (its backward all-gathers the input grad).
        assert result["reference_counts"] == ({"all_reduce": 1}, {"all_gather_into_tensor": 1})
        assert result["coc_counts"] == ({"all_reduce": 3}, {"all_gather_into_tensor": 1})


@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
def test_frozen_weight(pool2, kind, sp, options):
    results = pool2.run("layer_cases:compare", kind=kind, chunks=3, sequence_parallel=sp, seq=14,
                        layer_options={"frozen": True}, **options)
    for result in results:
        assert result["coc_calls"] == 1
        assert "weight_grad" not in result["keys"]
        assert max(result["errors"].values()) <= 1e-5


@pytest.mark.parametrize("kind,sp", [("row", False), ("row", True), ("column", True), ("column", False)],
                         ids=CASE_IDS)
@pytest.mark.parametrize("zero_out_wgrad", [False, True])
def test_gradient_accumulation_into_main_grad(pool2, kind, sp, zero_out_wgrad):
    for result in pool2.run("layer_cases:compare_main_grad", kind=kind, chunks=3, sequence_parallel=sp,
                            zero_out_wgrad=zero_out_wgrad):
        assert result["main_grad_error"] <= 1e-5
        assert result["grad_added_to_main_grad"] is True
        assert result["dummy_grad_shape_ok"]
        if zero_out_wgrad:
            assert result["dummy_grad_is_zero"]
        assert result["input_grad_error"] <= 1e-5


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_explicit_weight_argument(pool2, sp):
    for result in pool2.run("layer_cases:compare_explicit_weight", chunks=3, sequence_parallel=sp):
        assert result["coc_calls"] == 1
        assert max(result["errors"]) <= 1e-5
        assert result["layer_weight_untouched"]


@pytest.mark.parametrize("kind,layer_options,fragment", [
    ("row", {"is_expert": True, "skip_bias_add": True}, "expert layer"),
    ("column", {"is_expert": True}, "expert layer"),
    ("column", {}, "COC_ENABLE_IN_COLUMN_BACKWARD=1"),
])
def test_declined_calls_run_megatron_and_say_why_once(pool2, kind, layer_options, fragment):
    for result in pool2.run("layer_cases:fallback_is_megatron", kind=kind, chunks=4,
                            reason_fragment=fragment, layer_options=layer_options):
        assert result["calls"] == 0
        assert result["bitwise_equal"]
        assert result["said_times"] == 1


def test_mismatched_chunk_counts_fail_on_every_rank(pool2):
    messages = pool2.run("layer_cases:mismatched_config", chunks_by_rank=[2, 4])
    for message in messages:
        assert message is not None and "differs across the ranks" in message


@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_mlp_training_loss_sequence_matches(pool2, sp):
    for result in pool2.run("layer_cases:train_mlp", chunks=3, sequence_parallel=sp, seq=14):
        assert result["calls"] == 10  # 5 steps x (column + row)
        assert len(result["coc"]) == 5
        for coc, reference in zip(result["coc"], result["reference"]):
            assert abs(coc - reference) <= 1e-5 * max(1.0, abs(reference))


@newest_only  # torch.compile's handling of the patched forward: torch's, the same on every Megatron release
@pytest.mark.parametrize("kind,sp", [("row", False), ("row", True), ("column", True), ("column", False)],
                         ids=CASE_IDS)
def test_torch_compile_still_runs_coc(pool2, kind, sp):
    # dynamo silently traces the original function behind a wrapt proxy; our forward is a
    # plain function, so a compiled layer must still take the CoC path (chunked collectives).
    for result in pool2.run("layer_cases:compiled_call", kind=kind, chunks=3, sequence_parallel=sp):
        assert result["calls"] == 1
        assert max(result["errors"].values()) <= 1e-5
        forward, backward = coc_counts(kind, sp, 3)
        assert result["forward_counts"] == forward and result["backward_counts"] == backward


# Row without SP is left out: Megatron's own output there (its all-reduce Function returns
# its input) refuses in-place edits, so there is no reference to compare with.
@pytest.mark.parametrize("kind,sp", [("row", True), ("column", True), ("column", False)],
                         ids=["row-sp", "column-sp", "column-bwd"])
def test_output_can_be_modified_in_place(pool2, kind, sp):
    for result in pool2.run("layer_cases:output_modified_in_place", kind=kind, chunks=3, sequence_parallel=sp):
        assert result["calls"] == 1
        assert max(result["errors"]) <= 1e-5
