"""Stand-ins for the tensor-parallel linear classes of Megatron's Transformer Engine spec.

Transformer Engine cannot be installed here (CUDA only). coc-inject recognises TE layers by
class name and defining module (``megatron.core.extensions.transformer_engine``), never by
calling them, so these stand-ins carry exactly that: the real names, registered under the
real module path, as plain ``torch.nn.Module`` subclasses (no local-layer base class, as in
Megatron) with a weight of the right shape. Their forward is a plain matmul; CoC must not see
or count it. Verified only against these stand-ins, not against real TE classes.
"""

import sys
import types

import torch

TE_MODULE = "megatron.core.extensions.transformer_engine"
NAMES = ("TEColumnParallelLinear", "TERowParallelLinear", "TELayerNormColumnParallelLinear", "TELinear")


def _make(name):
    def __init__(self, input_size, output_size):
        torch.nn.Module.__init__(self)
        self.weight = torch.nn.Parameter(torch.randn(output_size, input_size) / input_size**0.5)

    def forward(self, x):
        return x @ self.weight.t(), None

    cls = type(name, (torch.nn.Module,), {"__init__": __init__, "forward": forward})
    cls.__module__ = TE_MODULE
    cls.__qualname__ = name
    return cls


CLASSES = {name: _make(name) for name in NAMES}


def register() -> dict:
    """Put the stand-ins on the TE module (the real one when importable, else a stub)."""
    module = sys.modules.get(TE_MODULE)
    if module is None:
        try:
            import importlib

            module = importlib.import_module(TE_MODULE)
        except Exception:
            module = sys.modules[TE_MODULE] = types.ModuleType(TE_MODULE)
    for name, cls in CLASSES.items():
        setattr(module, f"Fake{name}", cls)  # beside, not over, Megatron's own names
    return CLASSES
