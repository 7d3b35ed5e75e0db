"""Multi-copy parallel (``COC_MULTI_COPY``): two (or n) copies of the micro-batch through every
TransformerBlock, one computing while another's tensor-parallel collective is in flight, forward
and backward.

install (the hook and its patches) -> forward (what runs in Megatron's place: a block call as
copies or Megatron's, counted) -> splits (which calls run as copies, cut how) -> block (a call:
split, the copies, join; their backward in one autograd node). The forward: scheduler (the baton:
copies on threads take turns where they would wait for the network) <- collectives
(torch.distributed's waits become hand-overs); each copy's RNG state is kept by
coc_inject.rng_state. The backward, from autograd's one thread: cuts (the forward marks where a
copy's backward can stop with its collective in flight) -> segments (each copy's graph cut into
segments, the copies' nodes renumbered into bands that autograd's ready queue runs in a fixed
interleave); autograd_check (torch's autograd behaves as the bands assume: checked once). auto
(COC_MULTI_COPY=auto's trials).
"""
