"""Thin wrapper: `python benchmarks/nq.py ...` is `kvblend bench nq ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["nq", *sys.argv[1:]]))
