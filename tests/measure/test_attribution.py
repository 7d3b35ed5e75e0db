"""Who issued a collective (coc_inject/measure/attribution.py), from the caller's stack: coc-inject's own
control traffic is never a wing's, the job's own collectives are named by their module, and Megatron's
gradient reduce after the backward is the optimizer's phase (#43 item 4)."""

import torch

from coc_inject.measure import attribution


def _called_from(module: str, inner=None):
    """``issuer()`` as a collective wrapper sees it, called from code whose module is ``module``
    (``inner``: a module nearer the call, e.g. the tuner inside a wing)."""
    def collective():
        return attribution.issuer(depth=2)

    source = "def issue(call):\n    return call()\n"
    nearest = collective
    for name in ([inner] if inner else []) + [module]:
        scope = {"__name__": name}
        exec(compile(source, f"<{name}>", "exec"), scope)
        nearest = (lambda f, g: (lambda: f(g)))(scope["issue"], nearest)
    return nearest()


def test_control_traffic_inside_a_wing_is_coc_injects():
    assert _called_from("coc_inject.linears.router", inner="coc_inject.tuning.online") == "coc-inject"
    assert _called_from("coc_inject.moe.calls", inner="coc_inject.timer") == "coc-inject"
    assert _called_from("coc_inject.linears.router") == "linears"


def test_the_jobs_own_collective_is_named_by_its_module():
    assert _called_from("pretrain_gpt") == "job pretrain_gpt"
    assert _called_from("megatron.core.distributed.finalize_model_grads", inner=None) == "megatron data-parallel"


def test_megatrons_gradient_reduce_outside_the_backward_is_the_optimizer_phase():
    assert attribution.phase("megatron data-parallel") == "optimizer"
    assert attribution.phase("megatron optimizer") == "optimizer"
    assert attribution.phase("megatron tensor-parallel") == "forward"
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen.append(attribution.phase("megatron data-parallel"))
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen == ["backward"]
