"""`BlendConfig`: a strategy name and the settings that strategy declares, validated at once.

Each strategy is a selector class (`kvblend.blend.selectors`) that declares its own settings
with defaults and checks. A config holds only settings its strategy uses: a setting it would
ignore is an error, because a benchmark row or an example that silently ran another setting
than the one it names is worse than a clear line at construction.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvblend.blend.adapter import DecoderShape
from kvblend.blend.selectors import Selector, selector_class


class BlendConfig:
    """How a blended prefill decides which reused tokens to recompute.

    ``BlendConfig(strategy="attention", **settings)``. Strategies and their settings:

    - ``"attention"`` (default): a first pass computes the prompt's tail (the question, after
      the last document) over the reused KV; the reused tokens it attends to most are then
      recomputed at every layer. Settings: ``recompute_ratio`` (0.3, share of moved tokens
      recomputed), ``min_recompute`` (256: at least this many moved tokens recomputed, leading
      ones included), ``window`` (1: the probe ranks blocks of this many consecutive moved
      tokens by their summed score and recomputes whole blocks, the budget rounded up to whole
      blocks), ``per_document`` (16: each moved document first gets its own top this many
      tokens, the rest of the budget going to the top of all; the minima are the budget when
      they exceed it), ``lead_tokens`` (8, leading tokens of every moved document recomputed on
      top), ``short_document`` (32: moved documents of at most this many tokens recomputed
      whole), ``full_above`` (0.8: a blend whose estimated cost is above this share of a full
      prefill's recomputes every moved token; 1 never; ``stats.fallback`` says why),
      ``correction`` (0.75), ``stale_temperature`` (1), ``probe_tail`` (True: the first pass
      computes only the text after the last document; False: every uncached token, the text
      between documents included), ``guard`` (None: no guard; a tolerance
      on ``guard_signal`` past which the prompt is computed in full after the blend, ``inf``
      to record the signals only), ``guard_signal`` (``"shift"``, the total variation between
      the probe's next-token distribution and the blend's, escalating above the tolerance;
      ``"margin"``, the blend's top-1 minus top-2 probability, escalating below it; or ``"kl"``,
      ``"flip"``, ``"stale_mass"``, above it: `kvblend.blend.guard`).
    - ``"cacheblend"``: every moved token is computed up to a check layer, where the ones whose
      KV deviates most from the cache are kept. Settings: ``recompute_ratio`` (0.2),
      ``check_layer`` (1), ``deviation`` (``"value"``, or ``"key"`` as LMCache),
      ``ratio_schedule`` (gradual filtering ``((layer, ratio), ...)``: increasing layers,
      non-increasing ratios; replaces ``recompute_ratio`` and ``check_layer``),
      ``correction`` (0.5), ``stale_temperature`` (1).
    - ``"epic"``: the first ``epic_tokens`` (16) tokens of every moved document are recomputed.
      Settings: ``epic_tokens``, ``correction`` (0.5), ``stale_temperature`` (1).
    - ``"reuse"``: nothing is recomputed (the quality floor). No settings.
    - ``"full"``: every token is computed over the same token ids (the exact baseline). No
      settings.

    ``correction``: at every layer, each moved document's tokens that are not recomputed get
    this share of the mean K/V change its recomputed tokens show (the context the document
    missed is partly the same for all of its tokens), in ``[0, 1]``; 0 turns it off.
    ``stale_temperature``: after it, the keys of those tokens are divided by this temperature,
    so every later token (decoding's too) attends to them less sharply above 1, in
    ``[0.25, 4]``; 1 turns it off.

    A setting the strategy does not use raises ``ValueError``. Configs are immutable and
    hashable; `replace` returns a changed copy. Settings read as attributes
    (``config.recompute_ratio``).
    """

    __slots__ = ("_given", "_selector", "_settings", "strategy")

    strategy: str
    _settings: dict[str, Any]
    _given: dict[str, Any]
    _selector: type[Selector]

    def __init__(self, strategy: str = "attention", **settings: Any) -> None:
        selector = selector_class(strategy)
        object.__setattr__(self, "strategy", strategy)
        object.__setattr__(self, "_selector", selector)
        object.__setattr__(self, "_given", dict(settings))
        object.__setattr__(self, "_settings", selector.resolve(settings))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._settings[name]
        except KeyError:
            raise AttributeError(
                f"strategy {self.strategy!r} has no setting {name!r}"
                f" (its settings: {', '.join(self._settings) or 'none'})"
            ) from None

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("BlendConfig is immutable; use config.replace(...)")

    @property
    def settings(self) -> Mapping[str, Any]:
        """Every setting of the strategy, defaults filled in."""
        return dict(self._settings)

    @property
    def reads_cache(self) -> bool:
        """Whether the strategy reads cached KV (``full`` does not)."""
        return self._selector.reads_cache

    def selector(self) -> Selector:
        """Return a new selector of the strategy with these settings, for one prefill.

        The prefill's forecast and its blend ask the same selector; it keeps what its
        ``select`` decided for that prompt, so every prefill takes a new one.
        """
        return self._selector(self._settings)

    def check_model(self, shape: DecoderShape) -> None:
        """Raise ``ValueError`` if a setting does not fit the model.

        For example a check layer past the model's last layer.
        """
        self.selector().check_model(shape)

    def replace(self, **changes: Any) -> BlendConfig:
        """Return a copy with ``changes`` applied.

        ``strategy=`` switches strategy, keeping the settings given explicitly, which the new
        strategy must use.
        """
        strategy = changes.pop("strategy", self.strategy)
        return BlendConfig(strategy, **{**self._given, **changes})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlendConfig):
            return NotImplemented
        return (self.strategy, self._settings) == (other.strategy, other._settings)

    def __hash__(self) -> int:
        return hash((self.strategy, tuple(sorted(self._settings.items()))))

    def __repr__(self) -> str:
        settings = "".join(f", {name}={value!r}" for name, value in self._settings.items())
        return f"BlendConfig({self.strategy!r}{settings})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.strategy, self._given))


def check_config(config: object) -> None:
    """Refuse a ``config`` that is not a `BlendConfig` or None (before any model work)."""
    if config is not None and not isinstance(config, BlendConfig):
        hint = " (BlendConfig(strategy) takes a strategy name)" if isinstance(config, str) else ""
        raise TypeError(f"config must be a BlendConfig or None, got {type(config).__name__}{hint}")


def parse_setting(text: str) -> tuple[str, Any]:
    """``"name=value"`` as a setting: the value an int, a float, or else the string.

    ``ValueError`` when ``text`` is not ``NAME=VALUE``; the value is checked by `BlendConfig`.
    """
    name, equals, value = text.partition("=")
    if not equals or not name.isidentifier():
        raise ValueError(f"a setting is NAME=VALUE, such as lead_tokens=16; got {text!r}")
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


def _rebuild(strategy: str, settings: dict[str, Any]) -> BlendConfig:
    return BlendConfig(strategy, **settings)
