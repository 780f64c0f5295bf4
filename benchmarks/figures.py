"""Thin wrapper: `python benchmarks/figures.py ...` is `kvblend bench figures ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["figures", *sys.argv[1:]]))
