"""Where sequence copies meet: the attention.

Copy ``c`` holds the positions after copies ``0 .. c-1`` (sequence.py); its queries attend to its own
keys and values (causal) and to every earlier copy's (all visible). The copies take turns in the
forward with copy 0 first, so when copy ``c`` reaches a layer's attention, every earlier copy has
run that layer's attention already and published its keys and values there (:class:`Meeting`);
copy ``c`` never waits for a later copy.

While a block call runs as sequence copies, each layer's core attention (Megatron's local
``DotProductAttention``) answers through :meth:`Meeting.attend` (its ``forward`` set on the module
for the call, removed after):

* causal (no mask tensor, Megatron's causal mask, or a mask Megatron's fused softmax ignores:
  sequence.mask_kind decides before the block runs): one autograd node per copy
  (:class:`CopiesAttention`), the attention over parts the CP schedules run
  (context_parallel.blocks.forward_parts) through the device's fused kernel, or the reference kernel
  where none runs the call (coc_inject.attention_kernels): its own block causal, each earlier copy's
  full, merged by their log-sum-exp; its backward, from the final out and log-sum-exp, accumulates
  in fp32 and sends the earlier copies' key/value gradients into their graphs, where autograd adds
  them to those copies' own before their key/value projection's backward runs. Megatron's own
  attention is never called on a copy: its softmax would see a non-square score matrix (its fused
  causal kernel asserts square; above 4096 keys it would ignore a mask for one copy and apply it
  for another). Any other mask runs the block Megatron's way (sequence.reason says why);
* context parallelism (CP > 1): the layer's CP algorithm in each copy, over the keys and values of
  every copy so far (meeting_cp.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

from coc_inject import attention_kernels, copy_context, log
from coc_inject.context_parallel import blocks
from coc_inject.multi_copy import meeting_cp


def _to_kernel(t: torch.Tensor) -> torch.Tensor:
    """[S, B, H, D] -> [B, H, S, D] (contiguous)."""
    return t.permute(1, 2, 0, 3).contiguous()


class CopiesAttention(torch.autograd.Function):
    """Copy ``copy``'s attention: q ``[s, b, heads, d]`` against its own k/v ``[s, b, groups, d]`` (causal)
    and the earlier copies' (full) -> ``[s, b, heads * d]``; ``earlier``: (k, v, k in kernel layout, v in
    kernel layout) of each earlier copy. Returns gradients for q, k, v and every earlier k, v."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, scale, earlier, *earlier_kv):
        q4, k4, v4 = _to_kernel(q), _to_kernel(k), _to_kernel(v)
        copy = len(earlier)
        parts = [(ek4, ev4, (j,)) for j, (_, _, ek4, ev4) in enumerate(earlier)] + [(k4, v4, (copy,))]
        out, lse = blocks.forward_parts(kernel, q4, (copy,), parts, True, q4.shape[2], scale)
        out = out.to(q.dtype)
        ctx.save_for_backward(q4, out, lse, *(t for part in parts for t in part[:2]))
        ctx.kernel, ctx.scale, ctx.dtypes = kernel, scale, (q.dtype, k.dtype)
        s, b, heads, d = q.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    @staticmethod
    def backward(ctx, dout):
        q4, out, lse, *kv = ctx.saved_tensors
        s, b, heads, d = q4.shape[2], q4.shape[0], q4.shape[1], q4.shape[3]
        dout4 = dout.reshape(s, b, heads, d).permute(1, 2, 0, 3).contiguous().to(q4.dtype)
        copy = len(kv) // 2 - 1
        parts = [(kv[2 * j], kv[2 * j + 1], (j,)) for j in range(copy + 1)]
        dq, grads = blocks.backward_parts(ctx.kernel, q4, (copy,), parts, dout4, out, lse, True, s, ctx.scale)
        grads = [(dk.permute(2, 0, 1, 3).to(ctx.dtypes[1]), dv.permute(2, 0, 1, 3).to(ctx.dtypes[1])) for dk, dv in grads]
        own = grads.pop()
        return (dq.permute(2, 0, 1, 3).to(ctx.dtypes[0]), *own, None, None, None,
                *(g for pair in grads for g in pair))


class Meeting:
    """One block call's sequence copies at their attention: each copy's keys and values per layer,
    published at its attention for the later copies. ``mask``: "causal" for the call's mask tensor
    (sequence.mask_kind passed nothing else), None without one: causal either way."""

    def __init__(self, copies: int, mask: str | None, kernel_preference: str = attention_kernels.AUTO):
        self.copies, self.mask, self.preference = copies, mask, kernel_preference
        self.published: dict = {}  # (layer, copy) -> (k, v, k in kernel layout, v in kernel layout)
        self.kernels: dict = {}  # (device, dtype, head dim) -> the block kernel (attention_kernels.choose)

    @contextlib.contextmanager
    def answering(self, block):
        """Inside, each layer's core attention answers through :meth:`attend` (nothing stays after)."""
        cores = [layer.self_attention.core_attention for layer in block.layers]
        for core in cores:
            core.forward = functools.partial(self.attend, core, type(core).forward.__get__(core))
        try:
            yield
        finally:
            for core in cores:
                core.__dict__.pop("forward", None)
            self.published.clear()

    def _kernel(self, query):
        """The layer's block kernel for this call shape: the fused one, or the reference kernel where
        none runs it (said once), as the CP wing chooses (COC_ATTN_KERNEL=fused without one: refused
        before the block runs, sequence.reason)."""
        shape = (query.device.type, query.dtype, query.shape[-1])
        if shape not in self.kernels:
            choice = attention_kernels.choose(self.preference, *shape)
            if choice.fallback_reason is not None and self.preference != attention_kernels.REFERENCE:
                log.once(("attention-kernel-fallback", choice.fallback_reason), logging.WARNING,
                         f"sequence copies' attention on {shape[0]} in {str(shape[1]).removeprefix('torch.')}, head "
                         f"dim {shape[2]} runs the reference kernel (tiled fp32 torch ops, slower): "
                         f"{choice.fallback_reason}")
            self.kernels[shape] = choice.kernel
        return self.kernels[shape]

    def attend(self, layer, megatron_forward, query, key, value, attention_mask, attn_mask_type=None,
               attention_bias=None, packed_seq_params=None):
        copy = copy_context.current_copy()
        if copy is None:
            raise RuntimeError("multi-copy: a sequence copy's attention ran outside its copy (a recompute?); "
                               "sequence copies refuse recompute")
        earlier = []
        for j in range(copy):
            found = self.published.get((id(layer), j))
            if found is None:
                raise RuntimeError(f"multi-copy: copy {copy} reached an attention before copy {j} had run it: the "
                                   "copies' turns are not in order")
            earlier.append(found)
        plan = getattr(layer, "_coc_cp", None)
        if plan is not None and not plan.local:  # CP > 1: the layer's CP algorithm in each copy (meeting_cp.py)
            key, value = meeting_cp.repeated(plan, key, value)
            if copy + 1 < self.copies:
                self.published[(id(layer), copy)] = (key, value, None, None)
            return meeting_cp.attend(plan, layer, copy, query, key, value, [e[:2] for e in earlier])
        kernel = self._kernel(query)
        mine = (key, value, _to_kernel(key), _to_kernel(value))
        if copy + 1 < self.copies:
            self.published[(id(layer), copy)] = mine
        scale = layer.softmax_scale * (getattr(layer.scale_mask_softmax, "scale", None) or 1.0)
        if any(e[2] is None for e in earlier):
            earlier = [(k, v, _to_kernel(k), _to_kernel(v)) for k, v, *_ in earlier]
        return CopiesAttention.apply(query, key, value, kernel, scale, earlier,
                                     *(t for e in earlier for t in e[:2]))
