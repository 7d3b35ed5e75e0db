"""The training script's compute-only twin: ``pretrain_tiny_gpt.py`` with every floating-point collective a
no-op that zero-fills its output (an infinitely fast network; coc_inject.testbed.link.no_collectives, the
bench's twin), so its step time is the step's compute C alone. Its losses mean nothing. `make demo` runs it
beside the link's runs: with the communication M (off's exposed time, from COC_MEASURE) each variant's
share of the pipelining limit max(C, M) of the whole GPT step. Takes the script's own arguments.
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import megatron.core.tensor_parallel  # noqa: E402,F401 - Megatron's aliases of the collectives bound first

from coc_inject.testbed.link import no_collectives  # noqa: E402

SCRIPT = ROOT / "examples" / "pretrain_tiny_gpt.py"

if __name__ == "__main__":
    sys.argv = [str(SCRIPT), *sys.argv[1:]]
    with no_collectives():
        runpy.run_path(str(SCRIPT), run_name="__main__")
