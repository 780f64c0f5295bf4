"""Benchmarks: TTFT of every strategy and answer quality on generated QA and on NQ retrieval.

``kvblend bench ttft|figures|quality|nq|shapes|report`` (or the scripts in ``benchmarks/``); see
docs/benchmarks.md. `main(argv)` is the entry point of both.
"""

from .cli import main

__all__ = ["main"]
