"""Benchmarks: TTFT of every strategy and answer quality on generated QA and on NQ retrieval.

``kvblend bench <command>`` (``kvblend bench --help`` lists them; ``python -m kvblend.bench``
runs the same); see docs/benchmarks.md. `main(argv)` is the entry point. The results go to
``kvblend-bench/`` of the working folder (``$KVBLEND_BENCH_DIR``, or ``--output``); the ones
the project records are in ``benchmarks/results/``, written there only when asked.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``kvblend bench`` with ``argv`` (imported here: the package itself stays light)."""
    from kvblend.bench.cli import main as run

    return run(argv)
