"""Multi-copy parallel (``COC_MULTI_COPY``): two (or n) copies of the micro-batch through every
TransformerBlock, one computing while another's tensor-parallel collective is in flight.

install (the hook and its patches) -> block (a call: split, the copies, join; their backward in
one autograd node) -> scheduler (the baton: copies take turns where they would wait for the
network) <- collectives (torch.distributed's waits become hand-overs); rng (each copy's RNG
state); auto (COC_MULTI_COPY=auto's trials).
"""
