"""``python -m seqpar.train``: the same as ``seqpar train`` (see :mod:`seqpar.integrations.train`).

Local CPU ranks: ``python -m seqpar.train --nproc 4 --context-parallel 4``.
GPUs: ``torchrun --nproc-per-node 8 -m seqpar.train --context-parallel 4``.
"""

import sys

from seqpar.integrations.train import main

if __name__ == "__main__":
    sys.exit(main())
