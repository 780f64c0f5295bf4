"""Thin wrapper: `python benchmarks/precompute.py ...` is `kvblend bench ingest ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["ingest", *sys.argv[1:]]))
