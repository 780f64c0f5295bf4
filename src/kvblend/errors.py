"""The errors kvblend raises for what a caller can act on.

A model it cannot blend or cannot find, a blend refused or cancelled. Nothing here imports
another kvblend module, so every layer raises them.
"""

from __future__ import annotations

__all__ = [
    "BlendCancelledError",
    "BlendUnavailableError",
    "ModelNotFoundError",
    "UnsupportedModelError",
]


class UnsupportedModelError(ValueError):
    """The model's architecture is not one kvblend can blend."""


class ModelNotFoundError(FileNotFoundError):
    """No model was given and none could be found."""


class BlendUnavailableError(RuntimeError):
    """The model failed kvblend's parity self-check, so blending would produce wrong text."""


class BlendCancelledError(RuntimeError):
    """A prefill was cancelled through its ``cancel`` event (checked between layers)."""
