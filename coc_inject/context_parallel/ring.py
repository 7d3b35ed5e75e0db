"""Ring and Double-Ring schedules: key/value blocks travel around the ring while the block at
hand computes (communication over computation for attention).

A ring of n positions is cut into windows of ``window`` consecutive positions (MindSpeed's
``--cp-window-size``). The INNER ring passes blocks between neighbours of a window, one hop per
step; the OUTER exchange moves a window's blocks on to the next window (``window`` positions
further) while the inner ring runs. ``window == 1`` is the plain ring (every step an outer hop),
``1 < window < n`` Double-Ring. In backward the gradient accumulators of the blocks travel the
same way, each step's transfers overlapped with that step's compute, and one last hop brings
every block's gradient home.

Tensors: queries ``[B,G,R,S,D]`` (kernel shapes), a ring block ``kv = [2,B,G,Sk,D]`` (keys and
values packed: one transfer per hop).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from coc_inject.context_parallel import blocks, kernel, layout
from coc_inject.context_parallel.comm import exchange


@dataclass(frozen=True)
class Ring:
    """Who is where: ``ranks[p]`` is the global rank at ring position p, which starts with the
    key/value chunks ``chunk_ids[p]``; point-to-point goes through ``group``."""

    group: object
    ranks: tuple
    position: int
    window: int
    chunk_ids: tuple

    @property
    def size(self) -> int:
        return len(self.ranks)

    def inner_step(self, delta: int) -> int:
        """Global rank ``delta`` positions away inside my window."""
        base = self.position - self.position % self.window
        return self.ranks[base + (self.position - base + delta) % self.window]

    def outer_step(self, delta: int) -> int:
        return self.ranks[(self.position + delta * self.window) % self.size]

    def source(self, outer: int, inner: int) -> int:
        """Ring position whose block I hold at outer step ``outer``, inner step ``inner``."""
        base = self.position - self.position % self.window
        holder = base + (self.position - base - inner) % self.window
        return (holder - outer * self.window) % self.size


@lru_cache(maxsize=4096)
def _plan(q_ids, k_ids, causal):
    return layout.plan_blocks(q_ids, k_ids, causal)


def _start(ring: Ring, sends, recvs, outer: bool):
    step = ring.outer_step if outer else ring.inner_step
    return exchange(ring.group, [(t, step(+1)) for t in sends], [(t, step(-1)) for t in recvs])


def forward(ring: Ring, q, kv, q_ids, causal: bool, chunk_len: int, scale: float):
    """Attention of the local queries against every block of the ring: (out fp32, lse fp32)."""
    acc_out, acc_lse = kernel.new_accumulators(q)
    outer_steps = ring.size // ring.window
    outer_kv = kv
    for outer in range(outer_steps):
        outer_next = outer_pending = None
        if outer < outer_steps - 1:
            outer_next = torch.empty_like(outer_kv)
            outer_pending = _start(ring, [outer_kv], [outer_next], outer=True)
        current = outer_kv
        for inner in range(ring.window):
            inner_next = inner_pending = None
            if inner < ring.window - 1:
                inner_next = torch.empty_like(current)
                inner_pending = _start(ring, [current], [inner_next], outer=False)
            plan = _plan(q_ids, ring.chunk_ids[ring.source(outer, inner)], causal)
            blocks.forward(plan, q, current[0], current[1], chunk_len, scale, acc_out, acc_lse)
            if inner_pending is not None:
                inner_pending.wait()
                current = inner_next
        if outer_pending is not None:
            outer_pending.wait()
            outer_kv = outer_next
    return acc_out, acc_lse


def backward(ring: Ring, q, kv, dout, lse, delta, q_ids, causal: bool, chunk_len: int, scale: float):
    """(dq fp32 [B,G,R,S,D], dkv fp32 [2,B,G,Sk,D]) for the local queries and the local block."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    outer_steps = ring.size // ring.window
    outer_kv, travelling = kv, None  # travelling: gradient accumulator of the previous outer step's block
    for outer in range(outer_steps):
        sends, recvs, outer_next, arrived = [], [], None, None
        if outer < outer_steps - 1:
            outer_next = torch.empty_like(outer_kv)
            sends.append(outer_kv)
            recvs.append(outer_next)
        if travelling is not None:
            arrived = torch.empty_like(travelling)
            sends.append(travelling)
            recvs.append(arrived)
        outer_pending = _start(ring, sends, recvs, outer=True)
        # The gradient of this outer step's block from my window, after its trip round the window.
        travelling = _window_backward(ring, outer, q, outer_kv, dout, lse, delta, q_ids, causal, chunk_len, scale,
                                      dq)
        outer_pending.wait()
        if arrived is not None:
            travelling += arrived
        if outer_next is not None:
            outer_kv = outer_next
    if outer_steps == 1:
        return dq, travelling
    home = torch.empty_like(travelling)
    _start(ring, [travelling], [home], outer=True).wait()
    return dq, home


def _window_backward(ring, outer, q, kv, dout, lse, delta, q_ids, causal, chunk_len, scale, dq):
    current, travelling = kv, None
    for inner in range(ring.window):
        sends, recvs, inner_next, arrived = [], [], None, None
        if inner < ring.window - 1:
            inner_next = torch.empty_like(current)
            sends.append(current)
            recvs.append(inner_next)
        if travelling is not None:
            arrived = torch.empty_like(travelling)
            sends.append(travelling)
            recvs.append(arrived)
        pending = _start(ring, sends, recvs, outer=False)
        dkv = torch.zeros(current.shape, dtype=torch.float32, device=current.device)
        plan = _plan(q_ids, ring.chunk_ids[ring.source(outer, inner)], causal)
        blocks.backward(plan, q, current[0], current[1], dout, lse, delta, chunk_len, scale, dq, dkv[0], dkv[1])
        pending.wait()
        if arrived is not None:
            dkv += arrived
        travelling = dkv
        if inner_next is not None:
            current = inner_next
    if ring.window == 1:
        return travelling
    home = torch.empty_like(travelling)
    _start(ring, [travelling], [home], outer=False).wait()
    return home
