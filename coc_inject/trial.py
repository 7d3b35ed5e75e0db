"""A trial: one ``auto`` candidate run on the job's own layers, leaving them exactly as it found them.

Every wing's ``auto`` times its candidates on the real layers at a shape's first call
(tuning/online.py runs them all inside :func:`isolated`). A trial must not change the training:

* **gradients.** It takes gradients with ``torch.autograd.grad`` over detached inputs (and, for a
  block, its parameters as inputs), so no AccumulateGrad node runs: no ``.grad``, no DDP hook, no
  bucket marked ready. But Megatron's linears with ``gradient_accumulation_fusion`` (apex's kernel,
  on by default on every GPU job) and TE's with ``fuse_wgrad_accumulation`` add the weight gradient
  into ``main_grad`` inside the backward itself: both are off for the trial, and ``main_grad`` is
  taken off the parameters meanwhile, so any other writer fails loudly instead of adding silently.
  ``.grad``, ``main_grad`` and ``grad_added_to_main_grad`` are put back as they were.
* **random numbers.** torch's generators (CPU and every accelerator in use) and Megatron's RNG
  tracker's states, as found (rng_state.py): dropout in the job's own call draws what it would have
  without trials.

:func:`active` tells the coverage counters that a call is a trial's, not the job's.
"""

from __future__ import annotations

import contextlib

import torch

from coc_inject import rng_state

# Module flags that make a backward write into main_grad: Megatron's linears, TE's.
FUSION_FLAGS = ("gradient_accumulation_fusion", "fuse_wgrad_accumulation")
_MISSING = object()
_depth = 0
_entered = 0  # trials begun in this process (COC_MEASURE tells a step with trials by it)


def active() -> bool:
    """Whether the calling code runs inside a trial."""
    return _depth > 0


def entered() -> int:
    """How many trials this process has begun."""
    return _entered


def _parameters(modules) -> list:
    seen, found = set(), []
    for module in modules:
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                found.append(param)
    return found


@contextlib.contextmanager
def isolated(modules=()):
    """Inside, trials of ``modules`` (the layers, blocks or experts they run) leave the parameters'
    gradients, the fused accumulation flags and the RNG as found (module docstring). Nests."""
    global _depth, _entered
    _entered += 1
    submodules = {id(m): m for module in modules for m in module.modules()}.values()
    fused = [(m, flag, getattr(m, flag)) for m in submodules for flag in FUSION_FLAGS
             if getattr(m, flag, False) is True]
    params = _parameters(modules)
    kept = [(p, p.grad, p.__dict__.get("main_grad", _MISSING), p.__dict__.get("grad_added_to_main_grad", _MISSING))
            for p in params]
    rng = rng_state.save()
    for module, flag, _ in fused:
        setattr(module, flag, False)
    for param, _, main_grad, _ in kept:
        if main_grad is not _MISSING:
            del param.main_grad
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        for module, flag, value in fused:
            setattr(module, flag, value)
        for param, grad, main_grad, added in kept:
            if param.grad is not grad:
                param.grad = grad
            for name, value in (("main_grad", main_grad), ("grad_added_to_main_grad", added)):
                if value is _MISSING:
                    param.__dict__.pop(name, None)
                else:
                    setattr(param, name, value)
        rng_state.restore(rng)
