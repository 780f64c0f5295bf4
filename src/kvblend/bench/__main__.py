"""``python -m kvblend.bench`` is ``kvblend bench``."""

import sys

from kvblend.bench.cli import main

raise SystemExit(main(sys.argv[1:]))
