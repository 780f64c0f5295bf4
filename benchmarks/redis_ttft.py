"""Thin wrapper: `python benchmarks/redis_ttft.py ...` is `kvblend bench redis-ttft ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["redis-ttft", *sys.argv[1:]]))
