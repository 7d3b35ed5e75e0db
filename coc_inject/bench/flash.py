"""``python -m coc_inject.bench.flash`` (make bench-flash): the flash case, coc_inject.bench.cases.flash."""

import sys

from coc_inject.bench.cases.flash import main

if __name__ == "__main__":
    sys.exit(main())
