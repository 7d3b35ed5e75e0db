"""Ulysses: all-to-all from sequence-split to head-split and back.

Before attention, each rank of a group of u ranks trades its local rows of every head for all
rows of 1/u of the heads (one all-to-all for q, k and v together); after it, the reverse. The
gathered sequence is the concatenation of the group's local sequences, so its chunk ids are
``layout.gathered_chunks(group ranks)`` -- the block plan handles that order, no reordering.
Tensors here are in Megatron's ``[s, b, heads, d]``.
"""

from __future__ import annotations

import torch

from coc_inject.context_parallel.comm import all_to_all


def to_head_split(group, size: int, tensors):
    """Each ``[s, b, h_i, d]`` -> ``[size*s, b, h_i/size, d]``: all rows of the group, my share of heads."""
    s, b, _, d = tensors[0].shape
    shares = [t.shape[2] // size for t in tensors]
    packed = torch.cat([t.reshape(s, b, size, share, d) for t, share in zip(tensors, shares)], dim=3)
    stacked = packed.permute(2, 0, 1, 3, 4).contiguous()  # [size, s, b, heads/size, d]
    received = torch.empty_like(stacked)
    all_to_all(received, stacked, group).wait()
    return list(received.view(size * s, b, -1, d).split(shares, dim=2))


def to_sequence_split(group, size: int, tensors):
    """The inverse: each ``[size*s, b, h_i, d]`` -> ``[s, b, h_i*size, d]`` (my rows, all heads)."""
    rows, b, _, d = tensors[0].shape
    shares = [t.shape[2] for t in tensors]
    stacked = torch.cat(tensors, dim=2).view(size, rows // size, b, -1, d)
    received = torch.empty_like(stacked)
    all_to_all(received, stacked, group).wait()
    return [part.permute(1, 2, 0, 3, 4).reshape(rows // size, b, size * share, d)
            for part, share in zip(received.split(shares, dim=3), shares)]
