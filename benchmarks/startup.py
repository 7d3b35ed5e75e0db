"""Bootstrap start-up cost: see coc_inject/bench/startup.py."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from coc_inject.bench.startup import main  # noqa: E402

sys.exit(main())
