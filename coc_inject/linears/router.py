"""The linears' router: one Row / Column call that passed its guards -> its route.

``plan(call)`` gives CoC's chunked pipeline (``Chunked``), a fused kernel (``Fused``), or Megatron's
path with a reason (``MegatronPath``: 1 chunk configured for the shape, the copies chose Megatron's
linears, or ``COC_PARALLEL_NUM=auto`` measured Megatron's path fastest). It knows no Megatron
attribute: the call (adapters.LinearCall) carries its shape and two runners, which the auto
tuner's trials use.
"""

from __future__ import annotations

import logging

import torch

from coc_inject import copy_context, job, log
from coc_inject.config import AUTO, CocConfig
from coc_inject.pipeline import agreement, autocast
from coc_inject.routes import AUTO_CHOSE_MEGATRON, COPIES_CHOSE_MEGATRON, Chunked, Fused, MegatronPath

# Chunk count of a fused kernel's backward pipelines when COC_PARALLEL_NUM names none.
FUSED_FALLBACK_CHUNKS = 4
COPIES_CHOSE_MEGATRON_PATH = MegatronPath(COPIES_CHOSE_MEGATRON, expected=True)


class LinearRouter:
    """Plans the linears' calls for one resolved configuration, in one installation (coc_inject.job)."""

    def __init__(self, config: CocConfig, installation):
        self.config = config
        self.installation = installation

    def plan(self, call):
        """The route of a call that passed its guards: Chunked, Fused, or MegatronPath."""
        m, k, n = call.shape
        chunks = self.config.chunks_for(m, k, n)
        if chunks == 1:
            return MegatronPath(f"COC_CUSTOMIZED sets 1 chunk (off) for shape [{m}, {k}, {n}]", expected=True)
        if chunks == AUTO and not copy_context.linears_chunked():
            return COPIES_CHOSE_MEGATRON_PATH
        agreement.ensure_same_config(call.group, self.config)
        if chunks == -1:
            return self._fused(call)
        return self._tuned(call) if chunks == AUTO else Chunked(chunks)

    def _unfused(self, call):
        """Where a fused kernel was asked for but cannot run: COC_PARALLEL_NUM's count if it names
        one, else auto."""
        return Chunked(self.config.parallel_num) if self.config.parallel_num > 1 else self._tuned(call)

    def _fused(self, call):
        """A Fused route if a fused backend can run this call; otherwise say why once and chunk."""
        if call.fused_op is None:  # no communication to fuse in this forward; the backward is chunked
            return self._unfused(call)
        from coc_inject.linears.fused import registry
        from coc_inject.pipeline.functions import FusedKernel

        count = self.config.parallel_num if self.config.parallel_num > 1 else None
        op, x2d = call.fused_op, call.coc_input.reshape(-1, call.coc_input.shape[-1])
        instead = "using the chunked pipeline with " + (f"{count} chunks" if count else "auto-tuned chunks")
        cast = autocast.compute_dtype(x2d)
        if cast is not None and op == "all_gather_matmul" and autocast.operand(x2d, cast) is not x2d:
            # Megatron gathers the input in its own dtype and multiplies in the autocast dtype.
            log.once(("fused-autocast", op, str(x2d.dtype), str(cast)), logging.INFO,
                     f"CoC: {op} under autocast ({cast}) with a {x2d.dtype} input: a fused kernel gathers "
                     f"and multiplies in one dtype; {instead}")
            return self._unfused(call)
        # A backend's limits are read on the operands as autocast hands them to the matmul.
        backend = registry.select(op, autocast.seen_as(x2d, cast), autocast.seen_as(call.weight, cast), call.group,
                                  self.config.fused_backend, "CoC", instead)
        if backend is None:
            return self._unfused(call)
        log.once(("fused", op, backend.name), logging.INFO, f"{op}: fused kernel {backend.name}")
        # The fused forward's backward pipelines need a count before any call is tuned.
        return Fused(backend.name, FusedKernel(backend, count or FUSED_FALLBACK_CHUNKS))

    def _tuned(self, call):
        """COC_PARALLEL_NUM=auto: the count decided for this call's key (trials on its first call),
        or MegatronPath when that is Megatron's own path (N=1)."""
        from coc_inject.tuning.online import DecisionKey

        layer, coc_input, weight, group = call.layer, call.coc_input, call.weight, call.group
        backward = torch.is_grad_enabled() and (coc_input.requires_grad or weight.requires_grad)
        cast = autocast.compute_dtype(coc_input)  # a matmul under autocast runs (and is timed) in its dtype
        dtype = str(coc_input.dtype).replace("torch.", "") + ("" if cast is None else f"->{cast}".replace("torch.", ""))
        key = DecisionKey(call.case, *call.shape, dtype, group.size(), coc_input.device.type, backward)

        def run(chunks: int) -> None:
            # A detached input, gradients for it alone, inside the tuner's trial.isolated(layer): a
            # trial touches no parameter gradient, whichever path it runs.
            x = (call.megatron_input if chunks == 1 else coc_input).detach().requires_grad_(backward)
            output = (call.run_megatron(x) if chunks == 1 else call.run_coc(x, chunks))[0]
            if backward:
                torch.autograd.grad(output, [x], torch.ones_like(output))

        chunks = self.installation.tuner(job.LINEARS).chunks(key, group, coc_input.device, call.rows, run,
                                                             touches=(layer,))
        if chunks == 1:
            m, k, n = call.shape
            return MegatronPath(f"{AUTO_CHOSE_MEGATRON} (N=1) for [{m}, {k}, {n}]", expected=True)
        return Chunked(chunks)
