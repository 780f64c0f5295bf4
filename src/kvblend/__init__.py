"""kvblend: reuse the KV cache of retrieved documents wherever they land in a RAG prompt."""

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
