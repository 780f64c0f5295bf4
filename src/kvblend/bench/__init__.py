"""Benchmarks: TTFT of every strategy and answer quality on generated QA and on NQ retrieval.

``kvblend bench <command>`` (``kvblend bench --help`` lists them; the scripts in ``benchmarks/``
are thin wrappers over them); see docs/benchmarks.md. `main(argv)` is the entry point of both.
"""

from kvblend.bench.cli import main

__all__ = ["main"]
