"""Wrapped forwards: turn one Megatron layer call into a CoC case, or fall back with a reason.

This is the only module that knows Megatron's layer attributes. A call is routed to a CoC
autograd Function only when every feature it uses is honoured; anything else goes to the
layer's original forward and the reason is logged once per (layer class, reason).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch

from coc_inject import coverage, log
from coc_inject.config import AUTO, CocConfig
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


@dataclass(frozen=True)
class Fallback:
    """Why a call goes to Megatron's own forward. ``expected`` ones are logged at debug only."""

    reason: str
    expected: bool = False


@dataclass(frozen=True)
class Guard:
    """A Megatron feature the engine checks for, because ignoring it would give a wrong result."""

    feature: str
    since: tuple  # first megatron-core (major, minor) that has it
    handling: str


GUARDS = (
    Guard("tensor-parallel weight sharding (gtp_remat_size > 1)", (0, 19),
          "Megatron's path: layer.weight is a shard that Megatron gathers before the matmul"),
    Guard("output_dtype on ColumnParallelLinear", (0, 20),
          "Megatron's path when it differs from the input dtype (the GEMM writes another dtype)"),
    Guard("inference-optimized output all-gather (eval, gather_output)", (0, 18),
          "handled: CoC's output is gathered by Megatron's inference all-gather"),
    Guard("Megatron-FSDP parameters (__fsdp_param__) with gradient_accumulation_fusion", (0, 14),
          "handled: wgrad is written into weight.get_main_grad(), as Megatron does"),
    Guard("weight of another shape than the one CoC multiplies by", (0, 13),
          "Megatron's path"),
)


def _weight_fallback(layer, weight, expected: tuple) -> Fallback | None:
    gtp = getattr(layer, "gtp_remat_size", 1)
    if isinstance(gtp, int) and gtp > 1:
        return Fallback(f"tensor-parallel weight sharding (gtp_remat_size={gtp}): the weight is a shard "
                        "Megatron gathers before the matmul")
    if weight is not None and tuple(weight.shape) != expected:
        return Fallback(f"weight shape {tuple(weight.shape)} is not the [{expected[0]}, {expected[1]}] "
                        "this layer multiplies by")
    return None


def _common_fallback(layer, input_: torch.Tensor) -> Fallback | None:
    tp_size = layer.tp_group.size() if layer.tp_group is not None else 1
    if tp_size <= 1:
        return Fallback("tensor-parallel size 1: no collective to overlap", expected=True)
    if getattr(layer, "explicit_expert_comm", False):
        return Fallback("expert layer: its communication is done by the MoE token dispatcher", expected=True)
    offload = getattr(layer.config, "_cpu_offloading_context", None)
    if offload is not None and getattr(offload, "inside_context", False):
        return Fallback("activation CPU offloading is active for this call")
    if not input_.is_floating_point():
        return Fallback(f"input dtype {input_.dtype} is not floating point")
    return None


def _rows(input_) -> int:
    return input_.numel() // input_.shape[-1] if input_.dim() else 0


def row_shape(layer, input_) -> tuple:
    """[m, k, n] of a RowParallelLinear call (k: this rank's input columns)."""
    return _rows(input_), layer.input_size_per_partition, layer.output_size


def column_shape(layer, input_) -> tuple:
    """[m, k, n] of a ColumnParallelLinear call (m: all rows, gathered under SP)."""
    tp = layer.tp_group.size() if layer.tp_group is not None and layer.sequence_parallel else 1
    return _rows(input_) * tp, layer.input_size, layer.output_size_per_partition


class CocEngine:
    """Routes layer calls for one resolved configuration."""

    def __init__(self, config: CocConfig):
        self.config = config
        self.layout = MatmulLayout.from_config(config)
        self.calls = 0  # CoC calls made (status / tests); fallbacks are not counted
        self.coverage = None  # coverage.Coverage, set by patching.install()
        self.tuner = None  # tuning.Tuner, made at the first auto call
        if config.deterministic:
            # Read when the first communicator is built, so set before any kernel: ATB's LCCL
            # (deterministic tiling of its all-reduce) and HCCL (deterministic reductions; whether
            # that covers the MC2 ops is unconfirmed, docs/fused-backends.md §4).
            os.environ["LCCL_DETERMINISTIC"] = "1"
            os.environ["HCCL_DETERMINISTIC"] = "true"

    # -- helpers ---------------------------------------------------------------------------
    def _fall_back(self, layer, shape_of, fallback: Fallback, original: Callable, input_, *args, **kwargs):
        level = logging.DEBUG if fallback.expected else logging.INFO
        log.once((type(layer).__name__, fallback.reason), level,
                 f"{type(layer).__name__}: Megatron's own forward is used: {fallback.reason}")
        if self.coverage is not None:
            self.coverage.count(layer, coverage.megatron(fallback.reason), input_, shape_of)
        return original(layer, input_, *args, **kwargs)

    def _count_coc(self, layer, shape_of, kernel, input_, rows: int) -> None:
        """Count a call CoC ran; ``rows``: the row count its chunks split (per rank under SP)."""
        self.calls += 1
        if self.coverage is not None:
            route = (coverage.fused(kernel.backend.name) if isinstance(kernel, FusedKernel)
                     else coverage.chunked(effective_chunks(rows, kernel)))
            self.coverage.count(layer, route, input_, shape_of)

    def _chunks(self, layer, m: int, k: int, n: int) -> int | Fallback:
        chunks = self.config.chunks_for(m, k, n)
        if chunks == 1:
            return Fallback(f"COC_CUSTOMIZED sets 1 chunk (off) for shape [{m}, {k}, {n}]", expected=True)
        return chunks

    def _fallback_chunks(self) -> int:
        """Chunks of the pipelines that run where a fused kernel was asked for but cannot:
        COC_PARALLEL_NUM if it names a count, else auto (tuned)."""
        return self.config.parallel_num if self.config.parallel_num > 1 else AUTO

    def _kernel(self, op: str, x2d, weight, group, chunks: int):
        """The chunk count, or for ``chunks == -1`` (fused requested) a FusedKernel if a fused
        backend can run this call; otherwise say why once and use the chunked pipeline."""
        if chunks != -1:
            return chunks
        from coc_inject.fused import registry

        fallback_chunks = self._fallback_chunks()
        backend = registry.select(op, x2d, weight, group, self.config.fused_backend, "CoC",
                                  "using the chunked pipeline with "
                                  + ("auto-tuned chunks" if fallback_chunks == AUTO else f"{fallback_chunks} chunks"))
        if backend is None:
            return fallback_chunks
        log.once(("fused", op, backend.name), logging.INFO, f"{op}: fused kernel {backend.name}")
        # The fused forward's backward pipelines need a count before any call is tuned.
        return FusedKernel(backend, fallback_chunks if fallback_chunks != AUTO else FUSED_FALLBACK_CHUNKS)

    def ensure_agreement(self, group, device):
        """The once-per-group cross-rank config check (runs on the first CoC call anyway)."""
        agreement.ensure_same_config(group, self.config, device)

    # -- auto (COC_PARALLEL_NUM=auto) --------------------------------------------------------
    def _tuned(self, layer, case: str, shape: tuple, inputs: tuple, weight, group, rows: int, kernel,
               run_coc, run_megatron):
        """``kernel`` itself, or for AUTO the count ``auto`` decided for this call's key (trials on
        its first call); a Fallback when that is Megatron's own path (N=1).

        ``inputs``: (CoC's input, Megatron's forward input): they differ for a Row layer whose
        input Megatron scatters itself."""
        if kernel != AUTO:
            return kernel
        from coc_inject.tuning import DecisionKey, Tuner, cache_for

        if self.tuner is None:
            self.tuner = Tuner(self.config, cache_for(self.config))
        coc_input, megatron_input = inputs
        backward = torch.is_grad_enabled() and (coc_input.requires_grad or weight.requires_grad)
        key = DecisionKey(case, *shape, str(coc_input.dtype).replace("torch.", ""), group.size(),
                          coc_input.device.type, backward)

        def run(chunks: int) -> None:
            # Detached input and gradient_accumulation_fusion off: a trial touches no parameter
            # gradient (autograd.grad returns only the input's), whichever path it runs.
            x = (megatron_input if chunks == 1 else coc_input).detach().requires_grad_(backward)
            fusion, layer.gradient_accumulation_fusion = layer.gradient_accumulation_fusion, False
            try:
                output = run_megatron(x) if chunks == 1 else run_coc(x, chunks)
                if backward:
                    torch.autograd.grad(output, [x], torch.ones_like(output))
            finally:
                layer.gradient_accumulation_fusion = fusion

        chunks = self.tuner.chunks(key, group, coc_input.device, rows, run)
        if chunks == 1:
            return Fallback(f"{coverage.AUTO_CHOSE_MEGATRON} (N=1) for [{shape[0]}, {shape[1]}, {shape[2]}]",
                            expected=True)
        return chunks

    # -- RowParallelLinear -----------------------------------------------------------------
    def row_forward(self, original, layer, input_, *args, **kwargs):
        if args or kwargs:
            return self._fall_back(layer, row_shape, Fallback("unknown forward arguments (newer Megatron?)"),
                                   original, input_, *args, **kwargs)
        fallback = _common_fallback(layer, input_) or _weight_fallback(
            layer, layer.weight, (layer.output_size, layer.input_size_per_partition))
        if fallback is None and layer.sequence_parallel and input_.shape[0] % layer.tp_group.size():
            fallback = Fallback(f"sequence length {input_.shape[0]} is not divisible by TP")
        shape = row_shape(layer, input_)
        chunks = self._chunks(layer, *shape)
        fallback = fallback or (chunks if isinstance(chunks, Fallback) else None)
        if fallback is not None:
            return self._fall_back(layer, row_shape, fallback, original, input_)

        from megatron.core.tensor_parallel.mappings import scatter_to_tensor_model_parallel_region

        group = layer.tp_group
        input_parallel = (
            input_ if layer.input_is_parallel
            else scatter_to_tensor_model_parallel_region(input_, group=group)
        )
        self.ensure_agreement(group, input_parallel.device)
        op = "matmul_reduce_scatter" if layer.sequence_parallel else "matmul_all_reduce"
        x2d = input_parallel.reshape(-1, input_parallel.shape[-1])
        rows = x2d.shape[0] // group.size() if layer.sequence_parallel else x2d.shape[0]
        kernel = self._tuned(
            layer, "row-sp" if layer.sequence_parallel else "row", shape, (input_parallel, input_), layer.weight,
            group, rows, self._kernel(op, x2d, layer.weight, group, chunks),
            lambda x, n: self._row_output(layer, x, n, group), lambda x: original(layer, x)[0])
        if isinstance(kernel, Fallback):
            return self._fall_back(layer, row_shape, kernel, original, input_)
        output = self._row_output(layer, input_parallel, kernel, group)
        self._count_coc(layer, row_shape, kernel, input_, rows)
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
        def fall_back(fallback):
            return self._fall_back(layer, column_shape, fallback, original, input_, weight, runtime_gather_output,
                                   *args, **kwargs)

        if args or kwargs:
            return fall_back(Fallback("unknown forward arguments (newer Megatron?)"))
        fallback = _common_fallback(layer, input_)
        if fallback is not None:
            return fall_back(fallback)
        if layer.config.defer_embedding_wgrad_compute:
            return fall_back(Fallback("defer_embedding_wgrad_compute keeps its own wgrad buffers"))
        if getattr(layer, "disable_grad_reduce", False):
            return fall_back(Fallback("disable_grad_reduce: the caller reduces gradients itself", expected=True))
        sequence_parallel = layer.sequence_parallel
        if not sequence_parallel and not self.config.enable_coc_in_column_backward:
            return fall_back(Fallback(
                "no sequence parallelism: forward has no communication and Megatron already "
                "overlaps the backward all-reduce with wgrad (COC_ENABLE_IN_COLUMN_BACKWARD=1 "
                "chunks it)", expected=True))
        output_dtype = getattr(layer, "output_dtype", None)
        if output_dtype is not None and output_dtype != input_.dtype:
            return fall_back(Fallback(f"output_dtype {output_dtype} differs from the input dtype {input_.dtype}"))
        # The caller's ``weight`` argument is passed on unchanged by fall_back.
        matrix = layer.weight if weight is None else weight
        if matrix is None:
            return fall_back(Fallback("no weight supplied (skip_weight_param_allocation)"))
        fallback = _weight_fallback(layer, matrix, (layer.output_size_per_partition, layer.input_size))
        if fallback is not None:
            return fall_back(fallback)
        shape = column_shape(layer, input_)
        chunks = self._chunks(layer, *shape)
        if isinstance(chunks, Fallback):
            return fall_back(chunks)

        group = layer.tp_group
        self.ensure_agreement(group, input_.device)
        kernel = chunks
        if sequence_parallel:
            kernel = self._kernel("all_gather_matmul", input_.reshape(-1, input_.shape[-1]), matrix, group, chunks)
        elif chunks == -1:  # no communication to fuse in this forward; the backward is chunked
            kernel = self._fallback_chunks()
        rows = _rows(input_)
        kernel = self._tuned(
            layer, "column-sp" if sequence_parallel else "column-bwd", shape, (input_, input_), matrix, group,
            rows, kernel,
            lambda x, n: self._column_finish(layer, self._column_output(layer, x, matrix, n, group),
                                             runtime_gather_output, group)[0],
            lambda x: original(layer, x, weight, runtime_gather_output)[0])
        if isinstance(kernel, Fallback):
            return fall_back(kernel)
        output_parallel = self._column_output(layer, input_, matrix, kernel, group)
        self._count_coc(layer, column_shape, kernel, input_, rows)
        return self._column_finish(layer, output_parallel, runtime_gather_output, group)

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
