"""One rank of benchmarks/trials_cost.py: the tiny GPT script as ``__main__``, then this process's peak
resident memory (ru_maxrss) written to ``$TRIALS_COST_OUT/rss-<rank>.txt``."""

import os
import resource
import runpy
import sys

script = os.path.abspath(sys.argv[1])
sys.argv = [script, *sys.argv[2:]]
sys.path[0] = os.path.dirname(script)
try:
    runpy.run_path(script, run_name="__main__")
finally:
    with open(os.path.join(os.environ["TRIALS_COST_OUT"], f"rss-{os.environ.get('RANK', '0')}.txt"), "w") as file:
        file.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))  # KiB on Linux
