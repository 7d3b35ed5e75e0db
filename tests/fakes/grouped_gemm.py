"""Megatron's ``grouped_gemm`` extension for the tests' CPU ranks: the stand-in lives in the test bed
(coc_inject/testbed/grouped_gemm.py), where the bench's CPU ranks use it too; its contract, its checks
and its one stated difference from the CUDA kernel (fp32 taken beside bf16) are documented there."""

from coc_inject.testbed.grouped_gemm import DTYPES, GroupedGemm, calls, gmm, install, installed, module  # noqa: F401
