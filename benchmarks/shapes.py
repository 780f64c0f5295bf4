"""Thin wrapper: `python benchmarks/shapes.py ...` is `kvblend bench shapes ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["shapes", *sys.argv[1:]]))
