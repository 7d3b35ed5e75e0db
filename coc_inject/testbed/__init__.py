"""The test bed: Megatron models, layers, inputs and local ranks to measure and check on, for the
commands that measure (bench, selftest, tune) -- never imported by a training job.

ranks.py (where the ranks run: local CPU processes over gloo, or torchrun's) and link.py (the
emulated network link between two of them); models.py (megatron-core layers: a tensor-parallel
linear per layer case, a TransformerBlock, an MoE layer); attention.py (the context-parallel
attention's variants, schedules, inputs and the SDPA yardstick); cpu.py (Megatron's GPU-only pieces
made to run on CPU ranks: CpuLayerNorm, inert streams, gloo's split sizes); memory.py (how much
memory a call takes: the bytes autograd keeps for backward, the peak resident or device memory)."""
