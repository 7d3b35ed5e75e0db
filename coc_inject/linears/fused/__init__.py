"""Fused compute-communication kernels, detected at run time (never imported at start-up).

Backends are tried in order for each call; one that cannot run it says why (once) and the
next is tried; with none left the chunked pipeline runs. ``COC_FUSED_BACKEND`` pins one.
Backends: Ascend ATB "lcoc" LinearParallel (``torch_atb``), torch_npu's MC2 ops, and CUDA
symmetric memory (``torch.ops.symm_mem``); contracts and sources in docs/dev/fused-backends.md.
"""
