"""The copies' backward rests on private parts of torch's autograd (a node's _set_sequence_nr, the
ready queue running the highest sequence number first, torch._C._current_autograd_node); install
checks them once on a tiny graph, and where they do not behave as assumed every block runs
Megatron's forward with the reason, in the banner and the route counted."""

import pytest
import torch

from coc_inject import job
from coc_inject.config import CocConfig
from coc_inject.multi_copy import autograd_check, forward, install, segments
from tests.multi_copy.block_cases import numbers_left_as_they_are


@pytest.fixture
def fresh_check():
    """The check runs anew inside (its answer is cached per process), and after the test again."""
    autograd_check.reason.cache_clear()
    yield
    autograd_check.reason.cache_clear()


def test_this_torch_runs_the_copies_nodes_in_band_order_and_names_each_nodes_copy(fresh_check):
    assert autograd_check.reason() is None
    ran = autograd_check._run()
    assert [(copy, name) for copy, name, _ in ran] == autograd_check.EXPECTED
    assert all(seen == copy for copy, _, seen in ran), ran


def test_the_check_sees_an_order_renumbering_did_not_make(fresh_check, monkeypatch):
    monkeypatch.setattr(segments, "renumber", numbers_left_as_they_are)
    why = autograd_check.reason()
    assert why is not None and "another order" in why and torch.__version__ in why, why


def test_without_current_autograd_node_the_check_fails_with_the_error(fresh_check, monkeypatch):
    monkeypatch.delattr(torch._C, "_current_autograd_node")
    why = autograd_check.reason()
    assert why is not None and "AttributeError" in why and "_current_autograd_node" in why, why


def test_a_failed_check_makes_every_block_run_megatrons_forward_with_the_reason(fresh_check, monkeypatch):
    """Through install's own forward: Megatron's forward runs (a stand-in here), the route is no copies
    with the check's reason, and the banner says so."""
    from megatron.core.transformer import transformer_block

    monkeypatch.setattr(segments, "renumber", numbers_left_as_they_are)
    ran = []
    monkeypatch.setattr(transformer_block.TransformerBlock, "forward",
                        lambda self, hidden_states, *args, **kwargs: ran.append(hidden_states) or hidden_states)

    class Block:  # what the patched forward reads before it decides: the layers
        layers = [object(), object()]

    block, hidden = Block(), torch.ones(4, 2, 8)
    config = CocConfig(multi_copy=2)
    install.install(config, transformer_block)
    try:
        assert transformer_block.TransformerBlock.forward(block, hidden) is hidden
        banner = install.banner(config)
    finally:
        job.uninstall()
    why = autograd_check.reason()
    assert ran == [hidden]
    route = forward.last_route(block)
    assert (route.copies, route.reason) == (1, why) and "autograd" in why
    assert f"every block runs Megatron's: {why}" in banner
