"""vLLM with kvblend's connector against vanilla vLLM: ``kvblend bench vllm``.

Its speed (`speed`: TTFT by prompt length, requests/s, a streaming client's pauses while long
prompts arrive), its answers on the NQ benchmark's prompts paired with the engine's (`nq`,
``--nq``), and the OpenAI-compatible server both run as (`server`). It runs in vLLM's
environment (``.venv-vllm``). The package re-exports the names of the speed benchmark
(`speed`), the module this path named before the benchmarks were grouped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvblend.bench.vllm.speed import run_vllm_bench, serving, vllm_table

__all__ = ["run_vllm_bench", "serving", "vllm_table"]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - the vLLM benchmark's names, loaded on first use
    """Load the speed benchmark (and torch) on first use: the server module stays light."""
    if name in __all__:
        import importlib

        return getattr(importlib.import_module("kvblend.bench.vllm.speed"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
