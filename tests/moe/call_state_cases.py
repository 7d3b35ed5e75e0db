"""Worker functions for tests/moe/test_call_state.py: what one MoE layer call leaves behind on
Megatron's objects (after a call as pieces, one on Megatron's path and a failing one), and the host
synchronisations the package makes during a call."""

from __future__ import annotations

import sys

import torch

from tests.moe.moe_cases import _step, build_layer, layer_input, route_of, setup

# What the wing keeps per LAYER (not per call): the layer's last route and its verdict (coc_inject.verdicts).
PER_LAYER = {"_coc_moe", "_coc_moe_verdict"}


def coc_attributes(layer) -> list:
    """Every ``_coc*`` attribute on the layer's modules (dispatcher, experts, router, ...), but the
    layer's own per-layer records."""
    found = []
    for name, module in [("layer", layer), ("token_dispatcher", layer.token_dispatcher),
                         *layer.named_modules()]:
        for attribute in vars(module):
            if attribute.startswith("_coc") and not (module is layer and attribute in PER_LAYER):
                found.append(f"{name or 'layer'}.{attribute}")
    return sorted(set(found))


class _Failure(RuntimeError):
    pass


def _raise(*args):
    raise _Failure("a test's failure inside the experts")


def left_behind(coc: dict) -> dict:
    """After each kind of call: coc attributes left on Megatron's objects and whether a call is
    still current; then a call after the failing one still equals Megatron's."""
    from coc_inject.moe import calls

    setup(2, coc=None)
    layer = build_layer(experts=4, ep=2)
    x = layer_input("random", 24, 16)
    want = _step(layer, x)
    setup(2, coc=coc)
    result = {}
    _step(layer, x)
    result["pieces"] = (route_of(layer), coc_attributes(layer), calls._current.get() is not None)
    with torch.no_grad():
        layer(x)
    result["forward only"] = (route_of(layer), coc_attributes(layer), calls._current.get() is not None)
    hook = layer.experts.local_experts[0].register_forward_pre_hook(_raise)
    try:
        _step(layer, x)
        result["failing"] = "did not fail"
    except _Failure:
        result["failing"] = (coc_attributes(layer), calls._current.get() is not None)
    finally:
        hook.remove()
    got = _step(layer, x)
    result["after failing"] = (route_of(layer), (got[0] - want[0]).abs().max().item(),
                               (got[1] - want[1]).abs().max().item())
    return result


class HostSyncRecorder:
    """Every ``.item()``, ``.tolist()``, ``.cpu()``, ``.numpy()`` and tensor truth value the package's
    own code calls: (calling module, method)."""

    METHODS = ("item", "tolist", "cpu", "numpy", "__bool__")

    def __enter__(self):
        self.calls, self._own = [], {name: name in vars(torch.Tensor) for name in self.METHODS}
        self._originals = {name: getattr(torch.Tensor, name) for name in self.METHODS}
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, self._recording(name, original))
        return self

    def _recording(self, name, original):
        def recording(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("coc_inject."):
                self.calls.append((caller, name))
            return original(tensor, *args, **kwargs)

        return recording

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            if self._own[name]:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)


def host_syncs(coc: dict, experts: int = 4, etp: int = 1) -> dict:
    """The package's host synchronisations in one forward and one backward of a layer as pieces."""
    setup(2, etp=etp, coc=coc)
    layer = build_layer(experts=experts, ep=2, etp=etp)
    x = layer_input("random", 24, 16).requires_grad_()
    _step(layer, x)  # a first call: anything once per layer or shape happens here
    with HostSyncRecorder() as forward:
        out, _ = layer(x)
    with HostSyncRecorder() as backward:
        out.sum().backward()
    return {"route": route_of(layer), "forward": forward.calls, "backward": backward.calls}
