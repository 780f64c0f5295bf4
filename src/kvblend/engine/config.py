"""`BlendConfig`: every knob of a blended prefill, in one frozen, validated dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Strategy = Literal["attention", "cacheblend", "epic", "reuse", "full"]
DeviationMetric = Literal["value", "key"]

STRATEGIES: tuple[str, ...] = ("attention", "cacheblend", "epic", "reuse", "full")
METRICS: tuple[str, ...] = ("value", "key")


@dataclass(frozen=True)
class BlendConfig:
    """How a blended prefill decides which reused tokens to recompute.

    Attributes:
        strategy: ``"attention"`` recomputes the reused tokens that the prompt's uncached tail
            (the question) attends to most, found by a first pass that computes only the
            uncached tokens over the reused KV, and recomputes them at every layer;
            ``"cacheblend"`` recomputes the reused tokens whose KV deviates most at the
            check layer(s); ``"epic"`` recomputes the first ``epic_tokens`` tokens of every moved
            segment; ``"reuse"`` recomputes nothing (the quality floor); ``"full"`` recomputes
            every token over the same token ids (the exact baseline).
        recompute_ratio: fraction of the moved (reused, not prefix) tokens that ``attention``
            recomputes, and that ``cacheblend`` keeps recomputing after the last check layer,
            in ``[0, 1]``.
        check_layer: index of the layer at which ``cacheblend`` measures the KV deviation. Every
            layer before it is computed in full for all moved tokens. Ignored when
            ``ratio_schedule`` is given.
        deviation: ``"value"`` (squared L2 of V, original CacheBlend) or ``"key"`` (squared L2 of
            the un-rotated K, LMCache) deviation between fresh and reused KV.
        ratio_schedule: optional gradual filtering, ``((layer, ratio), ...)`` with increasing
            layers and non-increasing ratios: at each listed layer the recomputed set shrinks to
            the top ``ratio`` of moved tokens (chosen among those still recomputed). When given,
            the last ratio is the final recompute ratio and ``check_layer`` /
            ``recompute_ratio`` are not used.
        epic_tokens: how many leading tokens of each moved segment ``epic`` recomputes.
        correction: at every layer, each moved segment's tokens that are not recomputed get
            this share of the mean K/V change its recomputed tokens show (fresh minus cached;
            the context the segment missed is partly the same for all of its tokens), in
            ``[0, 1]``; 0 turns it off. A segment with no recomputed tokens gets the mean over
            every recomputed token. Used by ``attention``, ``cacheblend`` and ``epic``.
    """

    strategy: Strategy = "attention"
    recompute_ratio: float = 0.2
    check_layer: int = 1
    deviation: DeviationMetric = "value"
    ratio_schedule: tuple[tuple[int, float], ...] | None = field(default=None)
    epic_tokens: int = 16
    correction: float = 0.5

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(
                f"unknown strategy {self.strategy!r}; choose one of {', '.join(STRATEGIES)}"
            )
        if self.deviation not in METRICS:
            raise ValueError(
                f"unknown deviation metric {self.deviation!r}; choose one of {', '.join(METRICS)}"
            )
        _check_ratio("recompute_ratio", self.recompute_ratio)
        _check_ratio("correction", self.correction)
        if not isinstance(self.check_layer, int) or self.check_layer < 1:
            raise ValueError(
                f"check_layer must be an int >= 1, got {self.check_layer!r} (at layer 0 a token's "
                "K/V depend on the token alone, so there is no deviation to measure)"
            )
        if not isinstance(self.epic_tokens, int) or self.epic_tokens < 0:
            raise ValueError(f"epic_tokens must be a non-negative int, got {self.epic_tokens!r}")
        if self.ratio_schedule is not None:
            schedule = tuple(tuple(step) for step in self.ratio_schedule)
            if not schedule:
                raise ValueError("ratio_schedule must hold at least one (layer, ratio) step")
            previous_layer, previous_ratio = -1, 1.0
            for step in schedule:
                if len(step) != 2:
                    raise ValueError(f"ratio_schedule steps are (layer, ratio) pairs, got {step!r}")
                layer, ratio = step
                if not isinstance(layer, int) or layer < 1 or layer <= previous_layer:
                    raise ValueError("ratio_schedule layers must be increasing ints >= 1")
                _check_ratio("ratio_schedule ratio", ratio)
                if ratio > previous_ratio:
                    raise ValueError("ratio_schedule ratios must not increase from step to step")
                previous_layer, previous_ratio = layer, ratio
            object.__setattr__(self, "ratio_schedule", schedule)

    def schedule(self) -> tuple[tuple[int, float], ...]:
        """Return the check layers and ratios ``cacheblend`` applies: ``((layer, ratio), ...)``."""
        if self.ratio_schedule is not None:
            return self.ratio_schedule
        return ((self.check_layer, self.recompute_ratio),)

    def validate_for(self, num_layers: int) -> None:
        """Raise ``ValueError`` if a check layer does not exist in a model of ``num_layers``."""
        if self.strategy != "cacheblend":
            return
        for layer, _ in self.schedule():
            if layer >= num_layers:
                raise ValueError(
                    f"check layer {layer} is outside the model, which has {num_layers} layers "
                    f"(valid: 1..{num_layers - 1})"
                )


def _check_ratio(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
