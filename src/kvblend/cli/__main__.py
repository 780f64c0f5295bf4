"""``python -m kvblend.cli``: the ``kvblend`` command."""

import sys

from kvblend.cli.main import main

sys.exit(main())
