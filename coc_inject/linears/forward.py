"""The forward put on Megatron's Column/Row classes, and the wing object it closes over.

The replacement forwards are plain functions (closures), not wrapt proxies: torch.compile (dynamo)
traces a plain function, but silently traces the *original* code behind a wrapt FunctionWrapper,
which would turn CoC off under compile without a word.
"""

from __future__ import annotations

import functools
import logging

from coc_inject import log, mindspeed, verdicts
from coc_inject.pipeline.layout import effective_chunks
from coc_inject.routes import Chunked, Fused, MegatronPath


class Linears:
    """The linears' wing in one installation: its router, its adapters and what they counted."""

    def __init__(self, config, installation):
        from coc_inject.linears.adapters import ADAPTERS
        from coc_inject.linears.router import LinearRouter

        self.config = config
        self.installation = installation
        self.router = LinearRouter(config, installation)
        self.adapters = {name: adapter(config) for name, adapter in ADAPTERS.items()}
        self.calls = 0  # calls CoC ran (status / tests); Megatron's path is not counted here
        self.coverage = installation.armed_coverage()

    def count(self, call, route, shape_of) -> None:
        """Count a call CoC ran; a chunked one by the chunks its rows really split into."""
        self.calls += 1
        if self.coverage is not None:
            if isinstance(route, Chunked) and call.rows < route.chunks:
                route = Chunked(effective_chunks(call.rows, route.chunks))
            self.coverage.count(call.layer, route, call.megatron_input, shape_of)

    def decide(self, layer, adapter) -> verdicts.Verdict:
        """What the layer's class, construction, config and group decide for every call (None: each call's
        guards decide), kept on the layer (VERDICT) keyed by what it read; a MegatronPath is said here, once."""
        from coc_inject.allowlist import check

        path = beside_mindspeed(type(layer)) or adapter.layer_guard(layer)
        if path is not None:
            level = logging.DEBUG if path.expected else logging.INFO
            name = type(layer).__name__
            log.once((name, path.reason), level, f"{name}: Megatron's own forward is used: {path.reason}")
        config = layer.__dict__.get("config")
        read = check.reads(type(config), check.LINEARS) if config is not None else verdicts.nothing
        return verdicts.remember(self.installation, layer, VERDICT, config, read, layer.__dict__.get("tp_group"), path)

    def megatron_path(self, layer, path, input_, shape_of) -> None:
        """Say once why a call takes Megatron's path, and count it."""
        level = logging.DEBUG if path.expected else logging.INFO
        name = type(layer).__name__
        log.once((name, path.reason), level, f"{name}: Megatron's own forward is used: {path.reason}")
        if self.coverage is not None:
            self.coverage.count(layer, path, input_, shape_of)


_beside: dict = {}  # layer class -> MegatronPath naming MindSpeed's feature, or None


def beside_mindspeed(cls) -> MegatronPath | None:
    """Megatron's path for a layer whose class MindSpeed put in Megatron's place (its forward calls
    Megatron's only where MindSpeed's own CoC / MC2 leaves a call to it), else None."""
    if cls not in _beside:
        feature = mindspeed.class_feature(cls, mindspeed.LINEARS)
        _beside[cls] = None if feature is None else MegatronPath(
            mindspeed.aside(mindspeed.LINEARS, cls.__name__, feature).split(": ", 1)[1], expected=True)
    return _beside[cls]


VERDICT = "_coc_linears_verdict"  # on the layer: verdicts.Verdict of Linears.decide


def wrap(original, linears: Linears, adapter):
    """The forward put on a linear class: guard, plan, run CoC's path or Megatron's, count.

    What does not change between calls (the layer's class, construction, config, group) is decided at the
    first call and kept on the layer: a layer whose every call takes Megatron's path (TP 1, a refused
    setting) costs a verdict check and a count, then Megatron's forward."""
    shape_of = adapter.shape
    installation = linears.installation

    @functools.wraps(original)
    def forward(self, input_, *args, **kwargs):
        state = self.__dict__
        verdict = state.get(VERDICT)
        if verdict is None or not verdict.holds(installation, state.get("config"), state.get("tp_group")):
            verdict = linears.decide(self, adapter)
        path = verdict.value
        if path is not None:  # every call of this layer: said once at the decision
            coverage = linears.coverage
            if coverage is not None:
                coverage.count(self, path, input_, shape_of)
            return original(self, input_, *args, **kwargs)
        path = adapter.call_guard(self, input_, args, kwargs)
        if path is None:
            call = adapter.call(original, self, input_, args, kwargs)
            route = linears.router.plan(call)
            if not isinstance(route, MegatronPath):
                output = call.run_coc(call.coc_input, route.kernel if isinstance(route, Fused) else route.chunks)
                linears.count(call, route, shape_of)
                return output
            path = route
        linears.megatron_path(self, path, input_, shape_of)
        return original(self, input_, *args, **kwargs)

    forward.__coc_inject__ = True
    return forward
