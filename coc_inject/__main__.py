import sys

from coc_inject.cli import main

sys.exit(main())
