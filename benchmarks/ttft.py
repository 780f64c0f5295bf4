"""Thin wrapper: `python benchmarks/ttft.py ...` is `kvblend bench ttft ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["ttft", *sys.argv[1:]]))
