"""The GPU benchmarks: the figures a CUDA machine owes, and the runs that collect them.

``kvblend bench gpu`` (`figures`: TTFT, decode, peak memory and precompute against
transformers' own forward and ``generate``), decode from the static cache and compiled
(`decode`), a GPU memory tier (`tier`), models of a real model's shape with random weights
(`random_models`), the suite of every step (`suite`) and its summary against the GPU targets
(`suite_summary`), and the phases of the one-command GPU run (`run`, what
``scripts/gpu_run.sh`` runs); `figures`, `decode`, `suite` and `run` run on the CPU too
(``--device cpu``). The package re-exports the names of ``kvblend bench gpu`` (`figures`), the
module this path named before the benchmarks were grouped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvblend.bench.gpu.figures import (
        DEFAULT_LENGTHS,
        DEFAULT_STRATEGIES,
        add_gpu_arguments,
        baseline_table,
        gpu_table,
        parse_lengths,
        run_gpu,
        run_transformers,
        shape_tokenizer,
        shaped_engine,
    )

__all__ = [
    "DEFAULT_LENGTHS",
    "DEFAULT_STRATEGIES",
    "add_gpu_arguments",
    "baseline_table",
    "gpu_table",
    "parse_lengths",
    "run_gpu",
    "run_transformers",
    "shape_tokenizer",
    "shaped_engine",
]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - the GPU benchmark's names, loaded on first use
    """Load ``kvblend bench gpu`` (and torch) on first use: the GPU run's phases stay light."""
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("kvblend.bench.gpu.figures"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
