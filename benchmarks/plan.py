"""Tokenizing and matching a 12K-token string prompt vs the tokenizer: ``kvblend bench plan``."""

import sys

from kvblend.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["plan", *sys.argv[1:]]))
