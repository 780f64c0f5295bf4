"""Thin wrapper: `python benchmarks/report.py ...` is `kvblend bench report ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["report", *sys.argv[1:]]))
