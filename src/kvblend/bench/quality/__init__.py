"""Quality benchmarks: how far a blended answer is from full prefill's, on the same prompts.

The generated QA task (`qa`) and its benchmark (`qa_bench`), NQ-open over retrieved passages
(`nq`) run at a size that decides (`nq_eval`, with full prefill's answers kept by `baselines`),
every prompt shape in one report (`shapes`), documents precomputed behind other contexts
(`doc_context`), the guard's signals (`guard_calibration`) and the KV codecs' answers
(`codec_quality`); `compare` runs every strategy on one prompt beside full prefill and `stats`
gives the paired bootstrap intervals. The package re-exports the names of the QA benchmark
(`qa_bench`), the module this path named before the benchmarks were grouped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvblend.bench.quality.qa_bench import (
        STOP,
        evaluate_question,
        kl_divergence,
        prompt_segments,
        quality_report,
        quality_table,
        run_quality,
        summarize,
        type_table,
    )

__all__ = [
    "STOP",
    "evaluate_question",
    "kl_divergence",
    "prompt_segments",
    "quality_report",
    "quality_table",
    "run_quality",
    "summarize",
    "type_table",
]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - the QA benchmark's names, loaded on first use
    """Load the QA benchmark (and torch) on first use, so its sibling modules stay light."""
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("kvblend.bench.quality.qa_bench"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
