"""FAKE ``torch.ops.aten`` SDPA kernels of CUDA, on CPU tensors (tests only). NOT the real kernels.

Checks the call contract of ``aten._scaled_dot_product_flash_attention`` / ``_backward`` and
``aten._scaled_dot_product_efficient_attention`` / ``_backward`` as torch 2.13's schemas give them
(positional order, the keyword-only ``scale``, dtypes, [B, H, S, D] with a contiguous last dim,
the flash kernel's GQA, the efficient kernel's equal head counts and lse rows padded to a multiple
of 32, no dropout) and computes the true result (attention_math).
"""

from __future__ import annotations

import torch

import attention_math

CALLS: list = []


def _check_inputs(q, k, v, dtypes, gqa: bool):
    assert q.dim() == 4 and k.dim() == 4 and v.shape == k.shape, (q.shape, k.shape, v.shape)
    assert q.dtype in dtypes and k.dtype == q.dtype == v.dtype, (q.dtype, k.dtype)
    assert all(t.stride(-1) == 1 for t in (q, k, v)), "the last dim must be contiguous"
    assert q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3]
    assert (q.shape[1] % k.shape[1] == 0) if gqa else q.shape[1] == k.shape[1], (q.shape, k.shape)


def _scale(scale):
    assert isinstance(scale, float), f"scale is a float keyword argument, got {scale!r}"
    return scale


def _scaled_dot_product_flash_attention(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False,
                                        *, scale=None):
    _check_inputs(query, key, value, (torch.float16, torch.bfloat16), gqa=True)
    assert dropout_p == 0.0 and return_debug_mask is False and isinstance(is_causal, bool)
    assert query.shape[-1] % 8 == 0 and query.shape[-1] <= 256
    CALLS.append(("flash", tuple(query.shape), tuple(key.shape), is_causal))
    out, lse = attention_math.forward(query, key, value, _scale(scale), is_causal)
    sq, sk = query.shape[2], key.shape[2]
    return (out.to(query.dtype), lse.float(), None, None, sq, sk, torch.zeros(2, dtype=torch.int64),
            torch.empty(0, dtype=torch.int64), torch.empty(0))


def _scaled_dot_product_flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k,
                                                 max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *,
                                                 scale=None):
    _check_inputs(query, key, value, (torch.float16, torch.bfloat16), gqa=True)
    assert cum_seq_q is None and cum_seq_k is None, "not variable-length: undefined cumulative lengths"
    assert (max_q, max_k) == (query.shape[2], key.shape[2]) and dropout_p == 0.0
    assert grad_out.shape == out.shape == query.shape and out.dtype == query.dtype == grad_out.dtype
    assert logsumexp.dtype == torch.float32 and logsumexp.shape == query.shape[:3] and logsumexp.is_contiguous()
    assert isinstance(philox_seed, torch.Tensor) and isinstance(philox_offset, torch.Tensor)
    CALLS.append(("flash-backward", tuple(query.shape), tuple(key.shape), is_causal))
    grads = attention_math.backward(grad_out, query, key, value, out, logsumexp, _scale(scale), is_causal)
    return tuple(g.to(query.dtype) for g in grads)


def _padded(rows):
    return -(-rows // 32) * 32


def _scaled_dot_product_efficient_attention(query, key, value, attn_bias, compute_log_sumexp, dropout_p=0.0,
                                            is_causal=False, *, scale=None):
    _check_inputs(query, key, value, (torch.float32, torch.float16, torch.bfloat16), gqa=False)
    assert attn_bias is None and compute_log_sumexp is True and dropout_p == 0.0
    CALLS.append(("efficient", tuple(query.shape), tuple(key.shape), is_causal))
    out, lse = attention_math.forward(query, key, value, _scale(scale), is_causal)
    padded = torch.full((*lse.shape[:-1], _padded(lse.shape[-1])), float("inf"), dtype=torch.float32)
    padded[..., :lse.shape[-1]] = lse
    return out.to(query.dtype), padded, torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)


def _scaled_dot_product_efficient_attention_backward(grad_out_, query, key, value, attn_bias, out, logsumexp,
                                                     philox_seed, philox_offset, dropout_p, grad_input_mask,
                                                     is_causal=False, *, scale=None):
    _check_inputs(query, key, value, (torch.float32, torch.float16, torch.bfloat16), gqa=False)
    assert attn_bias is None and dropout_p == 0.0 and list(grad_input_mask) == [True, True, True, False]
    rows = query.shape[2]
    assert logsumexp.shape == (*query.shape[:2], _padded(rows)) and logsumexp.dtype == torch.float32
    CALLS.append(("efficient-backward", tuple(query.shape), tuple(key.shape), is_causal))
    grads = attention_math.backward(grad_out_, query, key, value, out, logsumexp[..., :rows], _scale(scale),
                                    is_causal)
    return (*(g.to(query.dtype) for g in grads), None)
