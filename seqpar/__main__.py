import sys

from seqpar.cli import main

sys.exit(main())
