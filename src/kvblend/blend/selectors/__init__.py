"""The registry of strategies: each is one `Selector` class in its own module.

Adding a strategy is one module with one `Selector` subclass and one line in `SELECTORS` below
(or `register(MySelector)` from outside the package). `BlendConfig(strategy, **settings)`
validates the settings that class declares.
"""

from __future__ import annotations

from kvblend.blend.selectors.attention import AttentionSelector
from kvblend.blend.selectors.base import (
    Fallback,
    Forecast,
    Selection,
    SelectionContext,
    Selector,
    Setting,
)
from kvblend.blend.selectors.cacheblend import CacheBlendSelector
from kvblend.blend.selectors.epic import EpicSelector
from kvblend.blend.selectors.full import FullSelector
from kvblend.blend.selectors.reuse import ReuseSelector

SELECTORS: dict[str, type[Selector]] = {
    AttentionSelector.name: AttentionSelector,
    CacheBlendSelector.name: CacheBlendSelector,
    EpicSelector.name: EpicSelector,
    ReuseSelector.name: ReuseSelector,
    FullSelector.name: FullSelector,
}


def register(selector: type[Selector]) -> type[Selector]:
    """Add ``selector`` under its ``name`` (usable as a class decorator).

    It must name itself and implement both `Selector.select` and `Selector.forecast` (what
    ``explain`` and vLLM's cached-token count report must be what the prefill does).
    """
    if not getattr(selector, "name", None):
        raise ValueError("a selector needs a non-empty class attribute `name`")
    for hook in ("select", "forecast"):
        if getattr(selector, hook, None) is getattr(Selector, hook):
            raise TypeError(f"selector {selector.name!r} must implement {hook}() (see Selector)")
    SELECTORS[selector.name] = selector
    return selector


def selector_class(strategy: str) -> type[Selector]:
    """Return the `Selector` class of ``strategy``; ``ValueError`` lists the known ones."""
    try:
        return SELECTORS[strategy]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown strategy {strategy!r}; choose one of {', '.join(SELECTORS)}"
        ) from None


def strategy_names() -> tuple[str, ...]:
    """Return every registered strategy, the default first."""
    return tuple(SELECTORS)


__all__ = [
    "SELECTORS",
    "Fallback",
    "Forecast",
    "Selection",
    "SelectionContext",
    "Selector",
    "Setting",
    "register",
    "selector_class",
    "strategy_names",
]
