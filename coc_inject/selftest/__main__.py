import sys

from coc_inject.selftest.run import main

sys.exit(main())
