"""``coc-inject selftest``: every wing checked on your own devices, each case against the truth on the
same device and inputs, with the backend named and the time of both.

    torchrun --nproc-per-node K -m coc_inject.selftest [--cases linears,moe] [--json PATH]
    coc-inject selftest [--world 2]      (no torchrun: local CPU ranks over gloo)

One module per wing (``WING``, ``run(ctx) -> rows``; common.py): linears.py (every CoC backend),
kernels.py (the attention kernels vs float64), context_parallel.py (each algorithm at CP = the world
size vs one rank's fused attention), multi_copy.py (a TransformerBlock with 2 copies vs none: batch, sequence, MoE),
moe.py (the MoE pieces vs Megatron's dispatcher) and meter.py (COC_MEASURE's exposed and hidden time of
a sleep-backed fake collective vs its true time). "CoC ms" is coc-inject's time, "ref ms" what it is
compared with: the unfused matmul + collective, the reference kernel, one rank's whole-sequence
attention, Megatron's block, Megatron's dispatcher; the meter's: its exposed time, the true one. A case that fails its bound makes the exit
status 1 and is named; cases a device cannot run are listed with why. The last line is the verdict: ``PASS``
(exit 0) only when every wing asked for was checked; ``PASSED WHAT RAN`` (exit 3) when nothing failed but a
wing, or some of its cases, was not checked here, named with why (megatron-core not importable: the
multi-copy and MoE cases; one rank: the multi-rank wings). ``COC_SELFTEST_DEVICE=npu`` picks the
Ascend NPU under torchrun.
"""
