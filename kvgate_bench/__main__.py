"""``python -m kvgate_bench``: the same as the ``kvgate-bench`` command."""

import sys

from kvgate_bench.cli import main

sys.exit(main())
