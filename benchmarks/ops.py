"""Aten ops per layer and host syncs per prefill, counted on the CPU: ``kvblend bench ops``."""

import sys

from kvblend.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["ops", *sys.argv[1:]]))
