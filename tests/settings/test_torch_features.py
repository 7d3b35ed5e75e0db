"""What coc-inject takes from torch beyond its floor (``torch>=2.4``) steps aside with a reason where a
torch lacks it, never raising (issue #42 item 5; docs/install.md "torch releases"): each check here
runs with the feature taken away."""

import types

import pytest
import torch
import torch.distributed as dist

from coc_inject import dist_interception
from coc_inject.config import CocConfig
from coc_inject.linears.fused import registry
from coc_inject.linears.fused.symm_mem import SymmMemBackend
from coc_inject.multi_copy import autograd_check, scheduler
from coc_inject.pipeline import collectives


# -- the single-tensor collectives (torch 2.13's all_gather_single / reduce_scatter_single) ----------

def test_without_the_single_collectives_the_pipeline_calls_the_tensor_forms(monkeypatch):
    calls = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: calls.append("all_gather_into_tensor"))
    monkeypatch.setattr(dist, "reduce_scatter_tensor", lambda *a, **k: calls.append("reduce_scatter_tensor"))
    collectives.all_gather_into_tensor_async(torch.zeros(4), torch.zeros(2), None)
    collectives.reduce_scatter_async(torch.zeros(2), torch.zeros(4), None)
    assert calls == ["all_gather_into_tensor", "reduce_scatter_tensor"]


def test_without_the_single_collectives_interception_skips_them(monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    sites = dist_interception._sites(lambda name, original: original, dist_interception.EVERY_COLLECTIVE, False)
    named = {name for owner, name, _ in sites if owner is dist}
    assert "all_reduce" in named and not named & set(dist_interception.SINGLE_TENSOR)


# -- the copies: the autograd check and the saved-tensor hooks getter ---------------------------------

@pytest.fixture
def fresh_check():
    autograd_check.reason.cache_clear()
    yield
    autograd_check.reason.cache_clear()


def test_without_current_autograd_node_the_copies_step_aside_with_the_reason(fresh_check, monkeypatch):
    monkeypatch.delattr(torch._C, "_current_autograd_node")
    why = autograd_check.reason()
    assert why is not None and "_current_autograd_node" in why and torch.__version__ in why, why


def test_without_set_sequence_nr_the_copies_step_aside_with_the_reason(fresh_check, monkeypatch):
    """torch's node types are C types (nothing to delete): a stand-in node lacking the method instead."""
    from coc_inject.multi_copy import segments

    real = segments.renumber

    def renumber(*args, **kwargs):
        raise AttributeError("'MulBackward0' object has no attribute '_set_sequence_nr'")

    monkeypatch.setattr(segments, "renumber", renumber)
    why = autograd_check.reason()
    assert why is not None and "AttributeError" in why and "_set_sequence_nr" in why, (why, real)


def test_without_the_hooks_getter_the_copies_run_where_no_saved_tensor_hooks_are_active(monkeypatch):
    monkeypatch.delattr(torch._C._autograd, autograd_check.HOOKS_GETTER)
    assert autograd_check.saved_hooks_reason() is None
    context = scheduler.ThreadContext()  # what each copy's thread takes on: no hooks to read
    assert context.hooks is None
    context.enter()
    context.exit()


def test_without_the_hooks_getter_a_call_under_saved_tensor_hooks_runs_megatrons_with_the_reason(monkeypatch):
    from coc_inject.multi_copy import forward

    monkeypatch.delattr(torch._C._autograd, autograd_check.HOOKS_GETTER)
    installation = types.SimpleNamespace(config=CocConfig(multi_copy=2))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        why = autograd_check.saved_hooks_reason()
        reason, arguments = forward.MultiCopy(installation, None).split(object(), None, (), {})
    assert arguments is None and reason == why
    assert why is not None and autograd_check.HOOKS_GETTER in why and torch.__version__ in why, why


def test_with_the_hooks_getter_nothing_is_probed(monkeypatch):
    monkeypatch.setattr(autograd_check, "_hooks_active", lambda: pytest.fail("probed"))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert autograd_check.saved_hooks_reason() is None


# -- the symmetric-memory fused backend ----------------------------------------------------------------

def test_a_torch_without_symmetric_memory_makes_the_backend_unavailable_with_the_reason(monkeypatch):
    backend = SymmMemBackend()
    monkeypatch.setattr(backend, "module", "torch.distributed._no_symmetric_memory")
    why = backend.unavailable()
    assert why is not None and "importing torch.distributed._no_symmetric_memory failed" in why, why


def test_a_torch_whose_symmetric_memory_registers_no_such_op_answers_no_kernel(monkeypatch):
    def missing(name, key):
        raise RuntimeError(f"operator {name} does not exist")

    monkeypatch.setattr(torch._C, "_dispatch_has_kernel_for_dispatch_key", missing)
    backend = SymmMemBackend()
    assert backend.unavailable() is not None
    assert registry.status()["symm_mem"] is not None  # coc-inject status: a reason, not an exception


def test_an_op_without_return_a_steps_aside_with_the_reason(monkeypatch):
    """torch 2.5's fused_all_gather_matmul took no return_A (added in 2.6): a stand-in schema without it."""
    arguments = [types.SimpleNamespace(name=name) for name in ("A", "Bs", "gather_dim", "group_name")]
    op = types.SimpleNamespace(default=types.SimpleNamespace(_schema=types.SimpleNamespace(arguments=arguments)))
    monkeypatch.setattr(torch.ops, "symm_mem", types.SimpleNamespace(fused_all_gather_matmul=op))
    backend = SymmMemBackend()
    monkeypatch.setattr(backend, "unavailable", lambda: None)
    monkeypatch.setattr(backend, "_has_kernel", lambda op_name, key: True)
    group = types.SimpleNamespace(size=lambda: 2)
    why = backend.unsupported("all_gather_matmul", torch.zeros(4, 2), torch.zeros(3, 2), group)
    assert why is not None and "no return_A argument" in why and torch.__version__ in why, why
    why = backend.unsupported("matmul_reduce_scatter", torch.zeros(4, 2), torch.zeros(3, 2), group)
    assert why is not None and "fused_matmul_reduce_scatter unreadable" in why, why


def test_this_torchs_symm_mem_ops_take_the_arguments_run_passes():
    pytest.importorskip("torch.distributed._symmetric_memory")
    for op_name in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter"):
        assert SymmMemBackend._schema_reason(op_name) is None


# -- the meter (COC_MEASURE) ---------------------------------------------------------------------------

@pytest.mark.parametrize("owner, name", [("torch._C", "_current_autograd_node"),
                                         ("torch.nn.modules.module", "register_module_forward_pre_hook")])
def test_a_torch_without_what_the_meter_reads_measures_nothing_with_the_reason(monkeypatch, owner, name):
    import importlib

    from coc_inject import job
    from coc_inject.measure import install

    monkeypatch.delattr(importlib.import_module(owner), name)
    all_reduce = dist.all_reduce
    config = CocConfig(measure=(1, None))
    try:
        assert install.install(config) is None
        assert dist.all_reduce is all_reduce  # nothing wrapped
    finally:
        job.uninstall()
    banner = install.banner(config)
    assert "not measuring" in banner and name in banner and torch.__version__ in banner, banner
