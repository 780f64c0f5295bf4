"""kvblend: reuse the KV cache of retrieved documents wherever they land in a RAG prompt."""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvblend.blend.config import BlendConfig
    from kvblend.decoding.generation import GenerationResult
    from kvblend.engine.engine import BlendEngine
    from kvblend.engine.results import BlendStats, PrefillResult
    from kvblend.errors import BlendUnavailableError, ModelNotFoundError, UnsupportedModelError
    from kvblend.models.decoder import SUPPORTED_FAMILIES
    from kvblend.prompt.segments import Segment

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


#: Where each public name is defined (loaded on first use).
_HOMES = {
    "SUPPORTED_FAMILIES": "kvblend.models.decoder",
    "BlendConfig": "kvblend.blend.config",
    "BlendEngine": "kvblend.engine.engine",
    "BlendStats": "kvblend.engine.results",
    "BlendUnavailableError": "kvblend.errors",
    "GenerationResult": "kvblend.decoding.generation",
    "ModelNotFoundError": "kvblend.errors",
    "PrefillResult": "kvblend.engine.results",
    "Segment": "kvblend.prompt.segments",
    "UnsupportedModelError": "kvblend.errors",
}


def __getattr__(name: str) -> Any:  # noqa: ANN401 - the engine's classes, loaded on first use
    """Load the engine (and torch) on first use, so ``kvblend --help`` starts at once."""
    if name in _HOMES:
        import importlib

        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'kvblend' has no attribute {name!r}")
