"""Document-finding cost with 100 vs 100,000 known documents: ``kvblend bench registry``."""

import sys

from kvblend.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["registry", *sys.argv[1:]]))
