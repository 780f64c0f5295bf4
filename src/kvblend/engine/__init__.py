"""The blending engine: pure torch + transformers, no disk and no frameworks."""

from .config import BlendConfig
from .decoder import SUPPORTED_FAMILIES, UnsupportedModelError
from .engine import BlendEngine, BlendStats, BlendUnavailableError, PrefillResult
from .generation import GenerationResult
from .loading import ModelNotFoundError
from .results import BlendCancelledError
from .segments import Segment

__all__ = [
    "SUPPORTED_FAMILIES",
    "BlendCancelledError",
    "BlendConfig",
    "BlendEngine",
    "BlendStats",
    "BlendUnavailableError",
    "GenerationResult",
    "ModelNotFoundError",
    "PrefillResult",
    "Segment",
    "UnsupportedModelError",
]
