"""Thin wrapper: `python benchmarks/doc_context.py ...` is `kvblend bench doc-context ...`."""

import sys

from kvblend.bench import main

if __name__ == "__main__":
    sys.exit(main(["doc-context", *sys.argv[1:]]))
