"""Context parallelism on Megatron's local ``DotProductAttention`` (which refuses CP by itself).

Data flow, one module per step:

    install.py     post-import hooks: patch DotProductAttention.__init__/forward, parallel_state
    forward.py     what runs there: a layer's plan at __init__, a call's run (or Megatron's), counted
    attention.py   per layer: the algorithm (COC_CP_ALGO or cp_comm_type), checks, masks
    schedule.py    per rank: groups, ring positions, chunk ids -> a Schedule
    function.py    one autograd Function per call, all transfers inside, fixed order
      ring.py        Ring / Double-Ring (key/value blocks around a ring, overlapped)
      ulysses.py     all-to-all over heads (Ulysses; with ring.py: hybrid)
      allgather.py   all-gather keys/values, reduce-scatter their gradients
    blocks.py      a block plan through the kernel
    (coc_inject.attention_kernels: block attention with log-sum-exp, pure tensor math)
    layout.py      Megatron's 2*CP chunk layout and block plans (pure arithmetic)
    comm.py        the transfers
    groups.py      hybrid's Ulysses groups, made where every rank passes (after initialize_model_parallel)
    auto.py        COC_CP_ALGO=auto: a shape's algorithm, timed at its first call
"""
