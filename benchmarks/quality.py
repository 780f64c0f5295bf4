"""Thin wrapper: `python benchmarks/quality.py ...` is `kvblend bench quality ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["quality", *sys.argv[1:]]))
