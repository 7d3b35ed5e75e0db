"""The settings agreement (coc_inject/pipeline/agreement.py) on 2 gloo ranks: through the job's store,
never the group's communicator, so a peer without coc-inject that issues Megatron's collectives on
that communicator neither pairs with the check nor hangs it (#41 item 8)."""

CASES = "tests.settings.agreement_cases"


def test_a_peer_that_never_joins_is_named_and_its_collective_is_untouched(pool2):
    rank0, rank1 = pool2.run(f"{CASES}:peer_never_joins")
    assert rank0["said"] is not None and "never joined" in rank0["said"] and "[1]" in rank0["said"], rank0
    assert rank1["said"] is None
    # each all-reduce summed the other rank's own value: the check's traffic paired with neither
    assert rank0["sum"] == rank1["sum"] == [3.0] * 4


def test_agreement_repeats_and_a_mismatch_is_said_on_every_rank(pool2):
    assert pool2.run(f"{CASES}:agree", parallel_num_by_rank=[4, 4]) == [[None, None]] * 2
    messages = pool2.run(f"{CASES}:agree", parallel_num_by_rank=[2, 4], rounds=1)
    assert all(m[0] and "differs across the ranks" in m[0] for m in messages), messages
