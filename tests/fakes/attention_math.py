"""The true result of one attention block, float64, for the FAKE attention kernels (tests only).

q ``[B, H, Sq, D]``, k/v ``[B, G, Sk, D]`` (query head h reads K/V head h // (H/G)); causal = a
square diagonal block. Backward follows the flash contract: the probabilities from the given lse,
the softmax term ``rowsum(dout * out)`` from the given (final) output.
"""

from __future__ import annotations

import torch


def _expand(t, heads):
    return t.double().repeat_interleave(heads // t.shape[1], dim=1)


def scores(q, k, scale, causal):
    s = q.double() @ _expand(k, q.shape[1]).transpose(-1, -2) * scale
    if causal:
        rows, cols = s.shape[-2:]
        assert rows == cols, "a causal block is square"
        s = s.masked_fill(torch.ones(rows, cols, dtype=torch.bool).triu(1), float("-inf"))
    return s


def forward(q, k, v, scale, causal):
    """(out float64, lse float64 [B, H, Sq])"""
    s = scores(q, k, scale, causal)
    lse = torch.logsumexp(s, dim=-1)
    return (s - lse.unsqueeze(-1)).exp() @ _expand(v, q.shape[1]), lse


def backward(dout, q, k, v, out, lse, scale, causal):
    """(dq, dk, dv) float64, dk/dv summed back to the K/V heads."""
    heads, groups = q.shape[1], k.shape[1]
    probs = (scores(q, k, scale, causal) - lse.double().unsqueeze(-1)).exp()
    dout = dout.double()
    dv = probs.transpose(-1, -2) @ dout
    dprobs = dout @ _expand(v, heads).transpose(-1, -2)
    dscores = probs * (dprobs - (dout * out.double()).sum(-1, keepdim=True)) * scale
    dq = dscores @ _expand(k, heads)
    dk = dscores.transpose(-1, -2) @ q.double()
    b, _, sk, d = k.shape
    return dq, dk.view(b, groups, -1, sk, d).sum(2), dv.view(b, groups, -1, sk, d).sum(2)
