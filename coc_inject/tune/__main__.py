import sys

from coc_inject.tune.run import main

sys.exit(main())
