"""Ring and Double-Ring schedules: key/value blocks travel around the ring while the block at
hand computes (communication over computation for attention).

A ring of n positions is cut into windows of ``window`` consecutive positions (MindSpeed's
``--cp-window-size``). The INNER ring passes blocks between neighbours of a window, one hop per
step; the OUTER exchange moves a window's blocks on to the next window (``window`` positions
further) while the inner ring runs. ``window == 1`` is the plain ring (every step an outer hop),
``1 < window < n`` Double-Ring. In backward the gradient accumulators of the blocks travel the
same way, each step's transfers overlapped with that step's compute, and one last hop brings
every block's gradient home.

Tensors: queries ``[B,H,S,D]`` (the kernels' shapes), a ring block ``kv = [2,B,G,Sk,D]`` (keys and
values packed: one transfer per hop).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from coc_inject.attention_kernels.merge import new_accumulators
from coc_inject.context_parallel import blocks, layout
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


def _pass_on(ring: Ring, block, travelling, outer: bool):
    """Start passing ``block`` and ``travelling`` (each may be None) one hop on, inner or outer:
    (pending, the block arriving, the accumulator arriving)."""
    sends, recvs, arriving_block, arriving = [], [], None, None
    if block is not None:
        arriving_block = torch.empty_like(block)
        sends.append(block)
        recvs.append(arriving_block)
    if travelling is not None:
        arriving = torch.empty_like(travelling)
        sends.append(travelling)
        recvs.append(arriving)
    return _start(ring, sends, recvs, outer), arriving_block, arriving


def forward(ring: Ring, kernel, q, kv, q_ids, causal: bool, chunk_len: int, scale: float):
    """Attention of the local queries against every block of the ring: (out fp32, lse fp32)."""
    acc_out, acc_lse = new_accumulators(q)
    touched: set = set()
    outer_steps = ring.size // ring.window
    outer_kv = kv
    for outer in range(outer_steps):
        last_outer = outer == outer_steps - 1
        outer_pending, outer_next, _ = _pass_on(ring, None if last_outer else outer_kv, None, outer=True)
        current = outer_kv
        for inner in range(ring.window):
            last_inner = inner == ring.window - 1
            inner_pending, inner_next, _ = _pass_on(ring, None if last_inner else current, None, outer=False)
            plan = _plan(q_ids, ring.chunk_ids[ring.source(outer, inner)], causal)
            blocks.forward(kernel, plan, q, current[0], current[1], chunk_len, scale, acc_out, acc_lse, touched)
            inner_pending.wait()
            current = current if last_inner else inner_next
        outer_pending.wait()
        outer_kv = outer_kv if last_outer else outer_next
    return acc_out, acc_lse


def backward(ring: Ring, kernel, q, kv, dout, out, lse, q_ids, causal: bool, chunk_len: int, scale: float):
    """(dq fp32 [B,H,S,D], dkv fp32 [2,B,G,Sk,D]) for the local queries and the local block; ``out``
    and ``lse`` are the final ones of the forward."""
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    outer_steps = ring.size // ring.window
    outer_kv, travelling = kv, None  # travelling: gradient accumulator of the previous outer step's block
    for outer in range(outer_steps):
        last_outer = outer == outer_steps - 1
        pending, outer_next, arrived = _pass_on(ring, None if last_outer else outer_kv, travelling, outer=True)
        # The gradient of this outer step's block from my window, after its trip round the window.
        travelling = _window_backward(ring, kernel, outer, q, outer_kv, dout, out, lse, q_ids, causal, chunk_len,
                                      scale, dq)
        pending.wait()
        if arrived is not None:
            travelling += arrived
        outer_kv = outer_kv if last_outer else outer_next
    if outer_steps == 1:
        return dq, travelling
    pending, _, home = _pass_on(ring, None, travelling, outer=True)
    pending.wait()
    return dq, home


def _window_backward(ring, kernel, outer, q, kv, dout, out, lse, q_ids, causal, chunk_len, scale, dq):
    current, travelling = kv, None
    for inner in range(ring.window):
        last_inner = inner == ring.window - 1
        pending, inner_next, arrived = _pass_on(ring, None if last_inner else current, travelling, outer=False)
        dkv = torch.zeros(current.shape, dtype=torch.float32, device=current.device)
        plan = _plan(q_ids, ring.chunk_ids[ring.source(outer, inner)], causal)
        blocks.backward(kernel, plan, q, current[0], current[1], dout, out, lse, chunk_len, scale, dq, dkv[0], dkv[1])
        pending.wait()
        if arrived is not None:
            dkv += arrived
        travelling = dkv
        current = current if last_inner else inner_next
    if ring.window == 1:
        return travelling
    pending, _, home = _pass_on(ring, None, travelling, outer=False)
    pending.wait()
    return home
