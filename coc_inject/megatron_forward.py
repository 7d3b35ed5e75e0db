"""Wrapped forwards: turn one Megatron layer call into a CoC case, or fall back with a reason.

With linear_guards.py, the only module that knows Megatron's layer attributes. A call is
routed to a CoC autograd Function only when every feature it uses is honoured; anything else
goes to the layer's original forward and the reason is logged once per (layer class, reason).
Row and Column calls take the same steps: their guards give a MegatronPath or nothing, then
:meth:`CocEngine.plan` turns a :class:`LinearCall` into its route (routes.py: chunked, fused,
tuned into one of those, or Megatron's path), which the forward runs and counts.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from coc_inject import copy_context, job, log
from coc_inject.config import AUTO, CocConfig
from coc_inject.linear_guards import column_guards, row_guards
from coc_inject.pipeline import agreement
from coc_inject.pipeline.functions import (
    AllGatherMatmul,
    FusedAllGatherMatmul,
    FusedKernel,
    FusedMatmulAllReduce,
    FusedMatmulReduceScatter,
    MatmulAllReduce,
    MatmulReduceScatter,
    MatmulWithChunkedGradAllReduce,
)
from coc_inject.pipeline.layout import effective_chunks
from coc_inject.pipeline.matmul import MatmulLayout
from coc_inject.pipeline.schedules import Schedule
from coc_inject.routes import AUTO_CHOSE_MEGATRON, COPIES_CHOSE_MEGATRON, Chunked, Fused, LayerCase, MegatronPath, Tuned


@dataclass(frozen=True)
class Case:
    """A layer/mode combination the engine handles, for ``status`` and the README."""

    layer: str
    mode: str
    forward: str
    backward: str
    schedule: Schedule


CASES = (
    Case("RowParallelLinear", "no SP", "mm + all-reduce, chunked", "local (no comm)", Schedule.COMPUTE_FIRST),
    Case("RowParallelLinear", "SP", "mm + reduce-scatter, chunked", "all-gather + dgrad mm, chunked (comm-first)", Schedule.COMPUTE_FIRST),
    Case("ColumnParallelLinear", "SP", "all-gather + mm, chunked", "dgrad mm + reduce-scatter, chunked; wgrad from re-gathered or kept input", Schedule.COMM_FIRST),
    Case("ColumnParallelLinear", "no SP", "mm (nothing to overlap)", "dgrad mm + all-reduce, chunked (COC_ENABLE_IN_COLUMN_BACKWARD=1)", Schedule.COMPUTE_FIRST),
)


# Chunk count of a fused kernel's backward pipelines when COC_PARALLEL_NUM names none.
FUSED_FALLBACK_CHUNKS = 4


def _rows(input_) -> int:
    return input_.numel() // input_.shape[-1] if input_.dim() else 0


def row_shape(layer, input_) -> tuple:
    """[m, k, n] of a RowParallelLinear call (k: this rank's input columns)."""
    return _rows(input_), layer.input_size_per_partition, layer.output_size


def column_shape(layer, input_) -> tuple:
    """[m, k, n] of a ColumnParallelLinear call (m: all rows, gathered under SP)."""
    tp = layer.tp_group.size() if layer.tp_group is not None and layer.sequence_parallel else 1
    return _rows(input_) * tp, layer.input_size, layer.output_size_per_partition




@dataclass
class LinearCall:
    """One Row or Column forward call, as :meth:`CocEngine.plan` needs it."""

    layer: object
    case: LayerCase
    shape: tuple  # [m, k, n]
    coc_input: torch.Tensor  # what CoC multiplies (Row: after Megatron's scatter of a non-parallel input)
    megatron_input: torch.Tensor  # what Megatron's own forward takes
    weight: torch.Tensor
    rows: int  # the row count its chunks split (per rank under SP)
    fused_op: str | None  # the op a fused kernel would run; None: this forward has no communication to fuse
    run_coc: Callable  # (input, chunk count) -> output: one of the tuner's trials
    run_megatron: Callable  # (input) -> output: Megatron's own path in the tuner's trials

    @property
    def group(self):
        return self.layer.tp_group


def _kernel(route):
    """What the autograd Function takes: a chunk count or the FusedKernel."""
    return route.kernel if isinstance(route, Fused) else route.chunks


TUNED = Tuned()


class CocEngine:
    """Routes layer calls for one resolved configuration, in one installation (coc_inject.job)."""

    def __init__(self, config: CocConfig, installation):
        self.config = config
        self.installation = installation
        self.layout = MatmulLayout.from_config(config)
        self.calls = 0  # CoC calls made (status / tests); fallbacks are not counted
        self.coverage = installation.armed_coverage()
        self._counted_chunks: dict[int, Chunked] = {}  # one route object per count: no allocation per call
        if config.deterministic:
            # Read when the first communicator is built, so set before any kernel: ATB's LCCL
            # (deterministic tiling of its all-reduce) and HCCL (deterministic reductions; whether
            # that covers the MC2 ops is unconfirmed, docs/fused-backends.md §4).
            os.environ["LCCL_DETERMINISTIC"] = "1"
            os.environ["HCCL_DETERMINISTIC"] = "true"

    @property
    def tuner(self):
        """COC_PARALLEL_NUM=auto's tuning.Tuner (None before the first auto call)."""
        return self.installation.tuners.get(job.LINEARS)

    @tuner.setter
    def tuner(self, tuner) -> None:
        self.installation.tuners[job.LINEARS] = tuner

    def ensure_agreement(self, group, device):
        """The once-per-group cross-rank config check (runs on the first CoC call anyway)."""
        agreement.ensure_same_config(group, self.config, device)

    # -- accounting ------------------------------------------------------------------------
    def _fall_back(self, layer, shape_of, path: MegatronPath, original: Callable, input_, *args, **kwargs):
        level = logging.DEBUG if path.expected else logging.INFO
        log.once((type(layer).__name__, path.reason), level,
                 f"{type(layer).__name__}: Megatron's own forward is used: {path.reason}")
        if self.coverage is not None:
            self.coverage.count(layer, path, input_, shape_of)
        return original(layer, input_, *args, **kwargs)

    def _count(self, call: LinearCall, route, shape_of) -> None:
        """Count a call CoC ran; a chunked one by the chunks its rows really split into."""
        self.calls += 1
        if self.coverage is not None:
            if isinstance(route, Chunked):
                chunks = effective_chunks(call.rows, route.chunks)
                route = self._counted_chunks.get(chunks) or self._counted_chunks.setdefault(chunks, Chunked(chunks))
            self.coverage.count(call.layer, route, call.megatron_input, shape_of)

    # -- the route of a call -----------------------------------------------------------------
    def plan(self, call: LinearCall):
        """The route of a call that passed its guards: Chunked, Fused, or MegatronPath (1 chunk
        configured for its shape, or auto measured Megatron's path fastest)."""
        m, k, n = call.shape
        chunks = self.config.chunks_for(m, k, n)
        if chunks == 1:
            return MegatronPath(f"COC_CUSTOMIZED sets 1 chunk (off) for shape [{m}, {k}, {n}]", expected=True)
        if chunks == AUTO and not copy_context.linears_chunked():
            return MegatronPath(COPIES_CHOSE_MEGATRON, expected=True)
        self.ensure_agreement(call.group, call.coc_input.device)
        if chunks == -1:
            route = self._fused(call)
        else:
            route = TUNED if chunks == AUTO else Chunked(chunks)
        return self._tuned(call) if route is TUNED else route

    def _unfused(self):
        """The route where a fused kernel was asked for but cannot run: COC_PARALLEL_NUM's count
        if it names one, else auto (tuned)."""
        return Chunked(self.config.parallel_num) if self.config.parallel_num > 1 else TUNED

    def _fused(self, call: LinearCall):
        """A Fused route if a fused backend can run this call; otherwise say why once and chunk."""
        unfused = self._unfused()
        if call.fused_op is None:  # no communication to fuse in this forward; the backward is chunked
            return unfused
        from coc_inject.fused import registry

        op, x2d = call.fused_op, call.coc_input.reshape(-1, call.coc_input.shape[-1])
        backend = registry.select(op, x2d, call.weight, call.group, self.config.fused_backend, "CoC",
                                  "using the chunked pipeline with "
                                  + ("auto-tuned chunks" if unfused is TUNED else f"{unfused.chunks} chunks"))
        if backend is None:
            return unfused
        log.once(("fused", op, backend.name), logging.INFO, f"{op}: fused kernel {backend.name}")
        # The fused forward's backward pipelines need a count before any call is tuned.
        backward_chunks = FUSED_FALLBACK_CHUNKS if unfused is TUNED else unfused.chunks
        return Fused(backend.name, FusedKernel(backend, backward_chunks))

    def _tuned(self, call: LinearCall):
        """COC_PARALLEL_NUM=auto: the count decided for this call's key (trials on its first call),
        or MegatronPath when that is Megatron's own path (N=1)."""
        if self.tuner is None:
            self.installation.tuner(job.LINEARS)
        from coc_inject.tuning.online import DecisionKey

        layer, coc_input, weight, group = call.layer, call.coc_input, call.weight, call.group
        backward = torch.is_grad_enabled() and (coc_input.requires_grad or weight.requires_grad)
        key = DecisionKey(call.case, *call.shape, str(coc_input.dtype).replace("torch.", ""), group.size(),
                          coc_input.device.type, backward)

        def run(chunks: int) -> None:
            # Detached input and gradient_accumulation_fusion off: a trial touches no parameter
            # gradient (autograd.grad returns only the input's), whichever path it runs.
            x = (call.megatron_input if chunks == 1 else coc_input).detach().requires_grad_(backward)
            fusion, layer.gradient_accumulation_fusion = layer.gradient_accumulation_fusion, False
            try:
                output = call.run_megatron(x) if chunks == 1 else call.run_coc(x, chunks)
                if backward:
                    torch.autograd.grad(output, [x], torch.ones_like(output))
            finally:
                layer.gradient_accumulation_fusion = fusion

        chunks = self.tuner.chunks(key, group, coc_input.device, call.rows, run)
        if chunks == 1:
            m, k, n = call.shape
            return MegatronPath(f"{AUTO_CHOSE_MEGATRON} (N=1) for [{m}, {k}, {n}]", expected=True)
        return Chunked(chunks)

    # -- RowParallelLinear -----------------------------------------------------------------
    def row_forward(self, original, layer, input_, *args, **kwargs):
        path = row_guards(layer, input_, args, kwargs)
        if path is not None:
            return self._fall_back(layer, row_shape, path, original, input_, *args, **kwargs)
        from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region

        group, sequence_parallel = layer.tp_group, layer.sequence_parallel
        input_parallel = (
            input_ if layer.input_is_parallel
            else scatter_to_tensor_model_parallel_region(input_, group=group)
        )
        rows = _rows(input_parallel) // group.size() if sequence_parallel else _rows(input_parallel)
        call = LinearCall(
            layer, LayerCase.of(row=True, sequence_parallel=sequence_parallel), row_shape(layer, input_),
            input_parallel, input_, layer.weight, rows,
            "matmul_reduce_scatter" if sequence_parallel else "matmul_all_reduce",
            lambda x, n: self._row_output(layer, x, n, group), lambda x: original(layer, x)[0])
        route = self.plan(call)
        if isinstance(route, MegatronPath):
            return self._fall_back(layer, row_shape, route, original, input_)
        output = self._row_output(layer, input_parallel, _kernel(route), group)
        self._count(call, route, row_shape)
        if layer.skip_bias_add:
            return output, layer.bias
        return (output + layer.bias if layer.bias is not None else output), None

    def _row_output(self, layer, input_parallel, kernel, group):
        arguments = (layer.weight, kernel, group, layer.gradient_accumulation_fusion, self.layout)
        if isinstance(kernel, FusedKernel):
            function = FusedMatmulReduceScatter if layer.sequence_parallel else FusedMatmulAllReduce
            rows = input_parallel.shape[0] // group.size() if layer.sequence_parallel else input_parallel.shape[0]
            x2d = input_parallel.reshape(-1, input_parallel.shape[-1])
            # 2-D through the Function, reshaped outside it: an ordinary view Megatron may edit in place.
            return function.apply(x2d, *arguments).view(rows, *input_parallel.shape[1:-1], -1)
        function = MatmulReduceScatter if layer.sequence_parallel else MatmulAllReduce
        return function.apply(input_parallel, *arguments)

    # -- ColumnParallelLinear --------------------------------------------------------------
    def column_forward(self, original, layer, input_, weight=None, runtime_gather_output=None, *args, **kwargs):
        path = column_guards(self.config, layer, input_, weight, args, kwargs)
        if path is not None:  # the caller's ``weight`` argument is passed on unchanged
            return self._fall_back(layer, column_shape, path, original, input_, weight, runtime_gather_output,
                                   *args, **kwargs)
        group, sequence_parallel = layer.tp_group, layer.sequence_parallel
        matrix = layer.weight if weight is None else weight

        def finish(output_parallel):
            return self._column_finish(layer, output_parallel, runtime_gather_output, group)

        call = LinearCall(
            layer, LayerCase.of(row=False, sequence_parallel=sequence_parallel), column_shape(layer, input_),
            input_, input_, matrix, _rows(input_), "all_gather_matmul" if sequence_parallel else None,
            lambda x, n: finish(self._column_output(layer, x, matrix, n, group))[0],
            lambda x: original(layer, x, weight, runtime_gather_output)[0])
        route = self.plan(call)
        if isinstance(route, MegatronPath):
            return self._fall_back(layer, column_shape, route, original, input_, weight, runtime_gather_output)
        output_parallel = self._column_output(layer, input_, matrix, _kernel(route), group)
        self._count(call, route, column_shape)
        return finish(output_parallel)
    def _column_output(self, layer, input_, matrix, kernel, group):
        tp_size = group.size()
        if layer.sequence_parallel:
            arguments = (matrix, kernel, group, layer.gradient_accumulation_fusion, self.layout,
                         self.config.recompute_all_gather)
            if isinstance(kernel, FusedKernel):
                x2d = input_.reshape(-1, input_.shape[-1])
                output_parallel, _ = FusedAllGatherMatmul.apply(x2d, *arguments)
                return output_parallel.view(input_.shape[0] * tp_size, *input_.shape[1:-1], -1)
            output_parallel, _ = AllGatherMatmul.apply(input_, *arguments)
            return output_parallel
        return MatmulWithChunkedGradAllReduce.apply(
            input_, matrix, kernel, group, layer.gradient_accumulation_fusion, self.layout
        )

    def _column_finish(self, layer, output_parallel, runtime_gather_output, group):
        """Bias and the output gather, as Megatron's forward does them."""
        if not layer.skip_bias_add and layer.bias is not None:
            output_parallel = output_parallel + layer.bias
        gather_output = layer.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather_output and getattr(layer, "use_inference_optimized_all_gather", False) and not layer.training:
            # megatron-core >= 0.18 (transformer_impl="inference_optimized"): its NVLS all-gather.
            from megatron.core.tensor_parallel.inference_layers import (
                inference_all_gather_from_tensor_model_parallel_region,
            )

            output = inference_all_gather_from_tensor_model_parallel_region(output_parallel, group, layer.config)
        elif gather_output:
            from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

            output = gather_from_tensor_model_parallel_region(output_parallel, group=group)
        else:
            output = output_parallel
        return output, (layer.bias if layer.skip_bias_add else None)
