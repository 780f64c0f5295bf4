"""kvblend: reuse the KV cache of retrieved documents wherever they land in a RAG prompt."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .engine import (
        SUPPORTED_FAMILIES,
        BlendConfig,
        BlendEngine,
        BlendStats,
        BlendUnavailableError,
        GenerationResult,
        ModelNotFoundError,
        PrefillResult,
        Segment,
        UnsupportedModelError,
    )

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_FAMILIES",
    "BlendConfig",
    "BlendEngine",
    "BlendStats",
    "BlendUnavailableError",
    "GenerationResult",
    "ModelNotFoundError",
    "PrefillResult",
    "Segment",
    "UnsupportedModelError",
    "__version__",
]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - the engine's classes, loaded on first use
    """Load the engine (and torch) on first use, so ``kvblend --help`` starts at once."""
    if name in __all__ and name != "__version__":
        from . import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'kvblend' has no attribute {name!r}")
