"""Fused compute-communication kernels, detected at run time (never imported at start-up).

Backends are tried in order for each call; one that cannot run it says why (once) and the
next is tried; with none left the chunked pipeline runs. ``COC_FUSED_BACKEND`` pins one.
This version wires Ascend ATB "lcoc" LinearParallel (``torch_atb``) and torch_npu's MC2 ops;
the CUDA symmetric-memory kernels are documented in docs/fused-backends.md, not wired yet.
"""
