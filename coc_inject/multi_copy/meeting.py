"""Where sequence copies meet: the attention.

Copy ``c`` holds the positions after copies ``0 .. c-1`` (sequence.py); its queries attend to its own
keys and values (causal) and to every earlier copy's (all visible). The copies take turns in the
forward with copy 0 first, so when copy ``c`` reaches a layer's attention, every earlier copy has
run that layer's attention already and published its keys and values there (:class:`Meeting`);
copy ``c`` never waits for a later copy.

While a block call runs as sequence copies, each layer's core attention (Megatron's local
``DotProductAttention``) answers through :meth:`Meeting.attend` (its ``forward`` set on the module
for the call, removed after):

* causal without a mask tensor, or with exactly Megatron's causal mask: one autograd node per copy
  (:class:`CopiesAttention`), the device's fused kernel (coc_inject.attention_kernels) on its own block
  (causal) and on each earlier copy's (full), merged by their log-sum-exp; its backward, from the
  final out and log-sum-exp, sends the earlier copies' key/value gradients into their graphs, where
  autograd adds them to those copies' own before their key/value projection's backward runs;
* any other mask that hides every later position (padding): Megatron's own attention on the copy's
  queries against the earlier copies' keys and values and its own, concatenated, with the mask's rows
  of the copy's positions and columns up to its last;
* no fused kernel for the call (device, dtype, head dim): the same as a mask, Megatron's attention;
* context parallelism (CP > 1): the layer's CP algorithm in each copy, over the keys and values of
  every copy so far (meeting_cp.py).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from coc_inject import attention_kernels, copy_context
from coc_inject.attention_kernels import merge
from coc_inject.multi_copy import meeting_cp


def _to_kernel(t: torch.Tensor) -> torch.Tensor:
    """[S, B, H, D] -> [B, H, S, D] (contiguous)."""
    return t.permute(1, 2, 0, 3).contiguous()


class CopiesAttention(torch.autograd.Function):
    """One copy's attention: q ``[s, b, heads, d]`` against its own k/v ``[s, b, groups, d]`` (causal) and
    the earlier copies' (full) -> ``[s, b, heads * d]``; ``earlier``: (k, v, k in kernel layout, v in
    kernel layout) of each earlier copy. Returns gradients for q, k, v and every earlier k, v."""

    @staticmethod
    def forward(ctx, q, k, v, kernel, scale, earlier, *earlier_kv):
        q4, k4, v4 = _to_kernel(q), _to_kernel(k), _to_kernel(v)
        blocks = [(ek4, ev4, False) for _, _, ek4, ev4 in earlier] + [(k4, v4, True)]
        out, lse = kernel.forward(q4, k4, v4, scale, True)
        if earlier:
            acc_out, acc_lse = merge.new_accumulators(q4)
            merge.first_into(acc_out, acc_lse, out, lse)
            for ek4, ev4, _ in blocks[:-1]:
                merge.merge_into(acc_out, acc_lse, *kernel.forward(q4, ek4, ev4, scale, False))
            out, lse = acc_out.to(q.dtype), acc_lse
        ctx.save_for_backward(q4, out, lse, *(t for block in blocks for t in block[:2]))
        ctx.kernel, ctx.scale, ctx.dtypes = kernel, scale, (q.dtype, k.dtype)
        s, b, heads, d = q.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, heads * d)

    @staticmethod
    def backward(ctx, dout):
        q4, out, lse, *kv = ctx.saved_tensors
        s, b, heads, d = q4.shape[2], q4.shape[0], q4.shape[1], q4.shape[3]
        dout4 = dout.reshape(s, b, heads, d).permute(1, 2, 0, 3).contiguous().to(q4.dtype)
        dq = None
        grads = []
        count = len(kv) // 2
        for j in range(count):
            dq_j, dk, dv = ctx.kernel.backward(dout4, q4, kv[2 * j], kv[2 * j + 1], out, lse, ctx.scale,
                                               j == count - 1)
            dq = dq_j if dq is None else dq + dq_j
            grads.append((dk.permute(2, 0, 1, 3).to(ctx.dtypes[1]), dv.permute(2, 0, 1, 3).to(ctx.dtypes[1])))
        own = grads.pop()
        return (dq.permute(2, 0, 1, 3).to(ctx.dtypes[0]), *own, None, None, None,
                *(g for pair in grads for g in pair))


class Meeting:
    """One block call's sequence copies at their attention: each copy's keys and values per layer,
    published at its attention for the later copies. ``mask``: "causal" or "general" for the call's
    mask tensor (sequence.mask_kind), None without one."""

    def __init__(self, copies: int, mask: str | None, kernel_preference: str = attention_kernels.AUTO):
        self.copies, self.mask, self.preference = copies, mask, kernel_preference
        self.published: dict = {}  # (layer, copy) -> (k, v, k in kernel layout, v in kernel layout)
        self.kernels: dict = {}  # (device, dtype, head dim) -> the fused kernel, or None

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
        shape = (query.device.type, query.dtype, query.shape[-1])
        if shape not in self.kernels:
            kernel = None
            if self.preference != attention_kernels.REFERENCE:
                kernel, _ = attention_kernels.fused_kernel(*shape)
            self.kernels[shape] = kernel
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
        kernel = self._kernel(query) if self.mask in (None, "causal") else None
        mine = (key, value) + ((_to_kernel(key), _to_kernel(value)) if kernel is not None else (None, None))
        if copy + 1 < self.copies:
            self.published[(id(layer), copy)] = mine
        if kernel is None:  # a padding mask, or no fused kernel: Megatron's attention on the keys so far
            return self._megatron(megatron_forward, copy, query, key, value, earlier, attention_mask, attn_mask_type)
        scale = layer.softmax_scale * (getattr(layer.scale_mask_softmax, "scale", None) or 1.0)
        if any(e[2] is None for e in earlier):
            earlier = [(k, v, _to_kernel(k), _to_kernel(v)) for k, v, *_ in earlier]
        return CopiesAttention.apply(query, key, value, kernel, scale, earlier,
                                     *(t for e in earlier for t in e[:2]))

    def _megatron(self, megatron_forward, copy, query, key, value, earlier, attention_mask, attn_mask_type):
        s = query.shape[0]
        keys = torch.cat([e[0] for e in earlier] + [key]) if earlier else key
        values = torch.cat([e[1] for e in earlier] + [value]) if earlier else value
        seq = s * self.copies
        if attention_mask is None:  # causal: Megatron's default mask is square, this one is not
            mask = torch.ones(s, seq, dtype=torch.bool, device=query.device).triu(1 + copy * s)[None, None]
        else:
            mask = attention_mask[..., copy * s:(copy + 1) * s, :]
        return megatron_forward(query, keys, values, mask[..., :(copy + 1) * s], attn_mask_type=attn_mask_type)
