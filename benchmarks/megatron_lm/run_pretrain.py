"""Run Megatron-LM's own ``pretrain_gpt.py`` on CPU ranks: apply the CPU shims, then the script as ``__main__``.

    torchrun --nproc-per-node 2 benchmarks/megatron_lm/run_pretrain.py CHECKOUT/pretrain_gpt.py ARGS...

The shims (cpu_shims.py) live here, outside coc-inject: coc-inject's bootstrap, when on PYTHONPATH,
has already run (as ``sitecustomize``) before this file, exactly as in a user's job.
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cpu_shims  # noqa: E402

script = os.path.abspath(sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path[0] = os.path.dirname(script)  # as `python pretrain_gpt.py` has it (gpt_builders, model_provider)
cpu_shims.apply()
runpy.run_path(script, run_name="__main__")
