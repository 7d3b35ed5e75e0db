"""What a MoE layer call leaves behind and what it makes the host wait for (issue 33, items 3 and 6):
Megatron's dispatcher, experts and layer carry no per-call state of coc-inject after a call -- as
pieces, forward-only, or failing inside the experts (Megatron's MoE recompute reads those objects
again from the backward) -- and a call as pieces makes exactly one host read of its own: the counts
Megatron's device-to-host copy already brought (no sync of the package's own)."""

import pytest

from tests.dist_harness import RankPool

PIECES = {"moe_overlap": "1"}


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2)
    yield pool
    pool.close()


def test_no_call_state_is_left_on_megatrons_objects(pool):
    for rank, r in enumerate(pool.run("tests.moe.call_state_cases:left_behind", coc=PIECES)):
        for kind in ("pieces", "forward only"):
            route, left, current = r[kind]
            assert route == ("pieces", 4) and left == [] and not current, (rank, kind, r[kind])
        assert r["failing"] == ([], False), (rank, r["failing"])
        route, out, x_grad = r["after failing"]
        assert route == ("pieces", 4) and out == 0.0 and x_grad == 0.0, (rank, r["after failing"])


@pytest.mark.parametrize("experts", [4, 2], ids=["2local", "1local"])
def test_a_call_as_pieces_reads_only_what_megatron_brought_to_the_host(pool, experts):
    for rank, r in enumerate(pool.run("tests.moe.call_state_cases:host_syncs", coc=PIECES, experts=experts)):
        assert r["route"][0] == "pieces", (rank, r["route"])
        assert r["forward"] == [("coc_inject.moe.counts", "tolist")], (rank, r["forward"])
        assert r["backward"] == [], (rank, r["backward"])
