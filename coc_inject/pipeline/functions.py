"""One autograd Function per CoC case, named for what it computes.

Notation: the matmul is ``y = x @ Wᵀ`` with ``x`` flattened to ``[m, k]`` and the
local weight shard ``W`` of shape ``[n, k]``. ``bounds`` are chunk row ranges from
:mod:`coc_inject.pipeline.layout`; under sequence parallelism they index the per-rank block
of the ``[TP, B, ...]`` view.

Every Function allocates on its input's device and writes every output row exactly once.
Weight gradients honour Megatron's contract: plain ``.grad`` by default; with
``gradient_accumulation_fusion`` they are accumulated into ``weight.main_grad`` (:mod:`coc_inject.pipeline.wgrad`:
the operands in their own dtype, through Megatron's kernel or torch's mixed-dtype GEMM where there is one)
and ``grad_added_to_main_grad`` is set when the parameter carries that attribute.
Under ``torch.autocast`` they compute as Megatron's autocast-aware Function does (:mod:`coc_inject.pipeline.autocast`):
matmul operands cast to the autocast dtype, outputs, dgrads and the collectives after them in it, the backward
in the forward's autocast dtype.
"""

from __future__ import annotations

import torch

from coc_inject.pipeline import collectives
from coc_inject.pipeline.autocast import compute_dtype, operand, result_dtype
from coc_inject.pipeline.layout import chunk_bounds
from coc_inject.pipeline.schedules import run_comm_first, run_compute_first
from coc_inject.pipeline.matmul import MatmulLayout, matmul_into
from coc_inject.pipeline.wgrad import into_main_grad


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    """``[..., h]`` -> ``[m, h]`` (a view when possible)."""
    return tensor.reshape(-1, tensor.shape[-1])


def _dgrad_buffer(tensor: torch.Tensor, cast) -> torch.Tensor:
    """Fresh contiguous buffer for the input gradient of ``tensor``, in the dgrad matmul's dtype (autograd
    casts it back to the input's) -- ``empty_like`` would copy a non-contiguous input's strides."""
    return torch.empty(tensor.shape, dtype=result_dtype(tensor, cast), device=tensor.device)


def _rank_blocks(tensor2d: torch.Tensor, tp_size: int) -> torch.Tensor:
    """``[m, h]`` -> ``[TP, m/TP, h]``: rank r's sequence-parallel block is ``[r]``."""
    return tensor2d.view(tp_size, -1, tensor2d.shape[-1])


class WeightGrad:
    """What a Function needs to produce the weight gradient the way Megatron would."""

    def __init__(self, weight: torch.Tensor, gradient_accumulation_fusion: bool, cast=None):
        self.needed = weight.requires_grad
        self.cast = cast  # the forward's autocast dtype (None: off): the plain wgrad matmul's, as autocast's
        # Megatron-FSDP parameters (megatron-core >= 0.14) hand out their main grad buffer at
        # backward time through get_main_grad(), and Megatron writes the wgrad into it.
        self.fsdp = bool(gradient_accumulation_fusion) and hasattr(weight, "__fsdp_param__")
        self.fusion = bool(gradient_accumulation_fusion) and (self.fsdp or hasattr(weight, "main_grad"))
        # Saved at forward time, like Megatron: the same module may be reused (MTP logits).
        self.main_grad = weight.main_grad if self.fusion and not self.fsdp else None

    def compute(self, weight: torch.Tensor, grad2d: torch.Tensor, input2d: torch.Tensor):
        """Return the ``grad_weight`` autograd expects (None when frozen or fully fused)."""
        if not self.needed:
            return None
        if not self.fusion:
            return operand(grad2d, self.cast).t().matmul(operand(input2d, self.cast))
        if self.fsdp:
            accum = weight.main_grad = weight.get_main_grad()
            into_main_grad(accum, grad2d, input2d, overwrite=True)
        else:
            weight.main_grad = self.main_grad
            accum = self.main_grad
            into_main_grad(accum, grad2d, input2d)
        if not hasattr(weight, "grad_added_to_main_grad"):
            return None
        # Megatron returns a dummy grad so backward hooks run on the main thread
        # (overlap_grad_reduce); zeros only when the parameter asks for it.
        make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
        weight.grad_added_to_main_grad = True
        return make(accum.shape, dtype=input2d.dtype, device=input2d.device)


class MatmulAllReduce(torch.autograd.Function):
    """RowParallel, no SP: ``AllReduce(x @ Wᵀ)``, compute-first. Backward is local."""

    @staticmethod
    def forward(ctx, x, weight, chunks, group, gradient_accumulation_fusion, layout: MatmulLayout):
        cast = compute_dtype(x)
        x2d = operand(_rows(x), cast)
        result = torch.empty(*x.shape[:-1], weight.shape[0], dtype=result_dtype(x, cast), device=x.device)
        out = _rows(result)
        matmul = layout.forward_matmul(operand(weight, cast), x.device.type)

        def compute(start, stop):
            return matmul(x2d[start:stop], out=out[start:stop])

        def communicate(start, stop, computed):
            return collectives.all_reduce_async(computed, group)

        run_compute_first(chunk_bounds(x2d.shape[0], chunks), compute, communicate)
        ctx.save_for_backward(x, weight)
        ctx.wgrad = WeightGrad(weight, gradient_accumulation_fusion, cast)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        cast = ctx.wgrad.cast
        grad2d = _rows(grad_output)
        grad_input = operand(grad2d, cast).matmul(operand(weight, cast)).view(x.shape)
        grad_weight = ctx.wgrad.compute(weight, grad2d, _rows(x))
        return grad_input, grad_weight, None, None, None, None


class MatmulReduceScatter(torch.autograd.Function):
    """RowParallel, SP: ``ReduceScatter_seq(x @ Wᵀ)``, compute-first.

    Backward: all-gather of the output gradient chunk by chunk, comm-first, each gathered
    chunk feeding its dgrad matmul; wgrad from the fully gathered gradient at the end.
    """

    @staticmethod
    def forward(ctx, x, weight, chunks, group, gradient_accumulation_fusion, layout: MatmulLayout):
        tp_size = group.size()
        cast = compute_dtype(x)
        x_blocks = _rank_blocks(operand(_rows(x), cast), tp_size)
        block_rows = x_blocks.shape[1]
        n = weight.shape[0]
        result = torch.empty(x.shape[0] // tp_size, *x.shape[1:-1], n, dtype=result_dtype(x, cast), device=x.device)
        out = _rows(result)
        matmul = layout.forward_matmul(operand(weight, cast), x.device.type)

        def compute(start, stop):
            # [TP, c, k] strided view in, contiguous [TP, c, n] out: rank-major, as RS wants.
            return matmul(x_blocks[:, start:stop])

        def communicate(start, stop, computed):
            return collectives.reduce_scatter_async(out[start:stop], _rows(computed), group)

        run_compute_first(chunk_bounds(block_rows, chunks), compute, communicate)
        ctx.save_for_backward(x, weight)
        ctx.chunks, ctx.group = chunks, group
        ctx.wgrad = WeightGrad(weight, gradient_accumulation_fusion, cast)
        return result

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        group = ctx.group
        tp_size = group.size()
        grad_shard = _rows(grad_output)
        block_rows = grad_shard.shape[0]
        grad_full = torch.empty(
            tp_size * block_rows, grad_shard.shape[1], dtype=grad_shard.dtype, device=grad_shard.device
        )
        grad_blocks = _rank_blocks(grad_full, tp_size)
        cast = ctx.wgrad.cast
        grad_input = _dgrad_buffer(x, cast)
        dgrad_blocks = _rank_blocks(_rows(grad_input), tp_size)
        weight_operand = operand(weight, cast)

        def communicate(start, stop):
            slots = list(grad_blocks[:, start:stop].unbind(0))
            return collectives.all_gather_async(slots, grad_shard[start:stop].contiguous(), group)

        def compute(start, stop):
            matmul_into(operand(grad_blocks[:, start:stop], cast), weight_operand, dgrad_blocks[:, start:stop])

        run_comm_first(chunk_bounds(block_rows, ctx.chunks), communicate, compute)
        grad_weight = ctx.wgrad.compute(weight, grad_full, _rows(x))
        return grad_input, grad_weight, None, None, None, None


class AllGatherMatmul(torch.autograd.Function):
    """ColumnParallel, SP: ``AllGather_seq(x) @ Wᵀ``, comm-first. Returns ``(output, gathered)``;
    the gathered input is a non-differentiable by-product ("ALL_GATHER_MATMUL_V2").

    Backward: dgrad matmul + reduce-scatter chunk by chunk (compute-first). wgrad needs the
    gathered input: re-gathered during the dgrad pipeline (``recompute_all_gather``) or kept
    from forward (more memory, less communication).
    """

    @staticmethod
    def forward(ctx, x, weight, chunks, group, gradient_accumulation_fusion, layout: MatmulLayout,
                recompute_all_gather):
        tp_size = group.size()
        x_shard = _rows(x)
        block_rows = x_shard.shape[0]
        n = weight.shape[0]
        # The input is gathered in its own dtype, as Megatron gathers it; each chunk is cast for its matmul.
        cast = compute_dtype(x)
        gathered = torch.empty(tp_size * block_rows, x_shard.shape[1], dtype=x.dtype, device=x.device)
        gathered_blocks = _rank_blocks(gathered, tp_size)
        result = torch.empty(x.shape[0] * tp_size, *x.shape[1:-1], n, dtype=result_dtype(x, cast), device=x.device)
        out = _rows(result)
        out_blocks = _rank_blocks(out, tp_size)
        matmul = layout.forward_matmul(operand(weight, cast), x.device.type)

        def communicate(start, stop):
            slots = list(gathered_blocks[:, start:stop].unbind(0))
            return collectives.all_gather_async(slots, x_shard[start:stop].contiguous(), group)

        def compute(start, stop):
            matmul(operand(gathered_blocks[:, start:stop], cast), out=out_blocks[:, start:stop])

        run_comm_first(chunk_bounds(block_rows, chunks), communicate, compute)
        wgrad = WeightGrad(weight, gradient_accumulation_fusion, cast)
        keep_gathered = wgrad.needed and not recompute_all_gather
        ctx.save_for_backward(x, weight, gathered if keep_gathered else None)
        ctx.chunks, ctx.group, ctx.wgrad = chunks, group, wgrad
        ctx.mark_non_differentiable(gathered)
        return result, gathered

    @staticmethod
    def backward(ctx, grad_output, _grad_gathered):
        x, weight, kept_gathered = ctx.saved_tensors
        group = ctx.group
        tp_size = group.size()
        grad2d = _rows(grad_output)
        grad_blocks = _rank_blocks(grad2d, tp_size)
        x_shard = _rows(x)
        block_rows = x_shard.shape[0]
        cast = ctx.wgrad.cast
        grad_input = _dgrad_buffer(x, cast)
        grad_input_rows = _rows(grad_input)
        weight_operand = operand(weight, cast)
        gathered, regather = kept_gathered, None
        if ctx.wgrad.needed and gathered is None:
            # Started first so it overlaps the dgrad matmuls below (Megatron does the same).
            gathered = torch.empty(
                tp_size * block_rows, x_shard.shape[1], dtype=x.dtype, device=x.device
            )
            regather = collectives.all_gather_into_tensor_async(gathered, x_shard.contiguous(), group)
        grad_weight = None

        def compute(start, stop):
            return torch.matmul(operand(grad_blocks[:, start:stop], cast), weight_operand)

        def communicate(start, stop, computed):
            return collectives.reduce_scatter_async(grad_input_rows[start:stop], _rows(computed), group)

        def weight_grad_while_scattering():
            nonlocal grad_weight
            collectives.wait_all([regather])
            grad_weight = ctx.wgrad.compute(weight, grad2d, gathered)

        run_compute_first(
            chunk_bounds(block_rows, ctx.chunks), compute, communicate, weight_grad_while_scattering
        )
        return grad_input, grad_weight, None, None, None, None, None


class MatmulWithChunkedGradAllReduce(torch.autograd.Function):
    """ColumnParallel, no SP: forward ``x @ Wᵀ`` (nothing to overlap); backward dgrad +
    all-reduce chunk by chunk (compute-first) with wgrad computed while the last chunks reduce.
    """

    @staticmethod
    def forward(ctx, x, weight, chunks, group, gradient_accumulation_fusion, layout: MatmulLayout):
        cast = compute_dtype(x)
        ctx.save_for_backward(x, weight)
        ctx.chunks, ctx.group = chunks, group
        ctx.wgrad = WeightGrad(weight, gradient_accumulation_fusion, cast)
        return layout.forward_matmul(operand(weight, cast), x.device.type)(operand(x, cast))

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        cast = ctx.wgrad.cast
        grad2d = _rows(grad_output)
        grad_input = _dgrad_buffer(x, cast)
        grad_input_rows = _rows(grad_input)
        weight_operand, grad_operand = operand(weight, cast), operand(grad2d, cast)
        grad_weight = None

        def compute(start, stop):
            return matmul_into(grad_operand[start:stop], weight_operand, grad_input_rows[start:stop])

        def communicate(start, stop, computed):
            return collectives.all_reduce_async(computed, ctx.group)

        def weight_grad_while_reducing():
            nonlocal grad_weight
            grad_weight = ctx.wgrad.compute(weight, grad2d, _rows(x))

        run_compute_first(
            chunk_bounds(grad2d.shape[0], ctx.chunks), compute, communicate, weight_grad_while_reducing
        )
        return grad_input, grad_weight, None, None, None, None


# --- fused kernels in the forward (and Row SP backward), chunked pipelines elsewhere ------------


class FusedKernel:
    """A fused backend chosen for one call, plus the chunk count of the chunked parts."""

    def __init__(self, backend, backward_chunks: int):
        self.backend = backend
        self.backward_chunks = backward_chunks


class FusedMatmulAllReduce(MatmulAllReduce):
    """RowParallel, no SP: one fused mm+all-reduce kernel. ``x`` is 2-D. Backward is local."""

    @staticmethod
    def forward(ctx, x, weight, kernel: FusedKernel, group, gradient_accumulation_fusion, layout):
        cast = compute_dtype(x)
        (out,) = kernel.backend.run("matmul_all_reduce", operand(x, cast), operand(weight, cast), group)
        ctx.save_for_backward(x, weight)
        ctx.wgrad = WeightGrad(weight, gradient_accumulation_fusion, cast)
        return out


class FusedMatmulReduceScatter(MatmulReduceScatter):
    """RowParallel, SP: fused mm+reduce-scatter forward; backward all-gathers the output gradient
    and multiplies in one fused kernel too, keeping the gathered gradient for wgrad ("V2")."""

    @staticmethod
    def forward(ctx, x, weight, kernel: FusedKernel, group, gradient_accumulation_fusion, layout):
        cast = compute_dtype(x)
        (out,) = kernel.backend.run("matmul_reduce_scatter", operand(x, cast), operand(weight, cast), group)
        ctx.save_for_backward(x, weight)
        ctx.kernel, ctx.group = kernel, group
        ctx.chunks = kernel.backward_chunks
        ctx.wgrad = WeightGrad(weight, gradient_accumulation_fusion, cast)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        cast = ctx.wgrad.cast
        grad_shard, weight_operand = operand(grad_output, cast).contiguous(), operand(weight, cast)
        # dgrad = AllGather(grad) @ W: W [n, k] is the [k', n'] = untransposed operand here.
        if ctx.kernel.backend.unsupported("all_gather_matmul", grad_shard, weight_operand, ctx.group) is not None:
            return MatmulReduceScatter.backward(ctx, grad_output)
        grad_input, grad_full = ctx.kernel.backend.run("all_gather_matmul", grad_shard, weight_operand, ctx.group,
                                                       trans_weight=False)
        grad_weight = ctx.wgrad.compute(weight, grad_full, x)
        return grad_input, grad_weight, None, None, None, None


class FusedAllGatherMatmul(AllGatherMatmul):
    """ColumnParallel, SP: fused all-gather+mm forward returning the gathered input ("V2"),
    kept for wgrad unless ``recompute_all_gather``; backward is the chunked dgrad+reduce-scatter."""

    @staticmethod
    def forward(ctx, x, weight, kernel: FusedKernel, group, gradient_accumulation_fusion, layout,
                recompute_all_gather):
        # Under autocast the router sends here only an input already in the autocast dtype (a fused
        # all-gather cannot carry Megatron's bytes and multiply in another dtype): only the weight is cast.
        cast = compute_dtype(x)
        out, gathered = kernel.backend.run("all_gather_matmul", x, operand(weight, cast), group)
        wgrad = WeightGrad(weight, gradient_accumulation_fusion, cast)
        keep_gathered = wgrad.needed and not recompute_all_gather
        ctx.save_for_backward(x, weight, gathered if keep_gathered else None)
        ctx.chunks, ctx.group, ctx.wgrad = kernel.backward_chunks, group, wgrad
        ctx.mark_non_differentiable(gathered)
        return out, gathered
