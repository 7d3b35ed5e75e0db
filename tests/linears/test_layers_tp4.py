"""The CoC cases on 4 real gloo ranks (TP=4), custom tp_groups, and cross-rank agreement.

seq=12, batch=1: m=12 rows, B=3 per rank under SP -- not divisible by TP*N for N=2 or 4, so
chunks are uneven (and N=8 collapses to one row per chunk).
"""

import pytest

from coc_inject.megatron_version import importable, release
from layer_checks import CASE_IDS, CASES, check_results

TP = 4


@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("chunks", [2, 3, 8])
def test_fp32_matches_unpatched(pool4, kind, sp, options, chunks):
    seq, batch = 12, 1
    results = pool4.run("layer_cases:compare", kind=kind, chunks=chunks, sequence_parallel=sp,
                        seq=seq, batch=batch, **options)
    check_results(results, kind=kind, sequence_parallel=sp, chunks=chunks,
                  rows_per_block=seq * batch // TP if sp else seq * batch)


@pytest.mark.skipif(release(importable().version) < (0, 13), reason="megatron-core 0.12's layers take no tp_group")
@pytest.mark.parametrize("kind,sp,options", CASES, ids=CASE_IDS)
def test_layer_uses_its_own_tp_group(pool4, kind, sp, options):
    results = pool4.run("layer_cases:compare_in_subgroups", kind=kind, chunks=3, sequence_parallel=sp)
    for result in results:
        assert result["group_size"] == 2
    check_results(results, kind=kind, sequence_parallel=sp, chunks=3,
                  rows_per_block=16 * 2 // 2 if sp else 16 * 2)


def test_one_rank_with_another_chunk_count_fails_everywhere(pool4):
    messages = pool4.run("layer_cases:mismatched_config", chunks_by_rank=[4, 4, 2, 4])
    for message in messages:
        assert message is not None and "differs across the ranks" in message
        assert "rank 2" in message


def test_mlp_training_sp_loss_sequence_matches(pool4):
    for result in pool4.run("layer_cases:train_mlp", chunks=2, sequence_parallel=True, seq=12, batch=2):
        assert result["calls"] == 10
        for coc, reference in zip(result["coc"], result["reference"]):
            assert abs(coc - reference) <= 1e-5 * max(1.0, abs(reference))
