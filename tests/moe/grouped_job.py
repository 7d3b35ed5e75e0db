"""Tests only: examples/pretrain_tiny_gpt.py with ``--moe-grouped-gemm``, the CPU stand-in of Megatron's
CUDA-only ``grouped_gemm`` extension (coc_inject/testbed/grouped_gemm.py) installed first, as the layer
tests install it; the script itself runs unmodified (``python grouped_job.py SCRIPT_ARGS...``)."""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # this checkout's stand-in (with or without coc-inject's bootstrap)
    from coc_inject.testbed import grouped_gemm

    grouped_gemm.install()
    sys.argv = [str(SCRIPT), *sys.argv[1:], "--moe-grouped-gemm"]
    runpy.run_path(str(SCRIPT), run_name="__main__")
