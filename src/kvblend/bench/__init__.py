"""Benchmarks: TTFT of every strategy and answer quality on a generated multi-document QA task.

``kvblend bench ttft|figures|quality|report`` (or the scripts in ``benchmarks/``); see
docs/benchmarks.md. `main(argv)` is the entry point of both.
"""

from .cli import main

__all__ = ["main"]
