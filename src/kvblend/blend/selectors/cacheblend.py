"""``cacheblend``: recompute the moved tokens whose cached KV deviates most (CacheBlend, 2024).

Every moved token is computed up to a check layer; there, the fresh value (or, as LMCache does,
key) projection of every computed row is compared with the cached one, and only the moved
rows deviating most stay computed for the remaining layers. A ratio schedule narrows the set in
steps (gradual filtering). The rows are chosen on the device (a ``topk`` of a size the host
knows) and not read back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch

from kvblend.blend.adapter import DecoderShape, ModelAdapter
from kvblend.blend.selectors.base import (
    CORRECTION,
    RECOMPUTE_RATIO,
    STALE_TEMPERATURE,
    Forecast,
    Narrowing,
    Selection,
    SelectionContext,
    Selector,
    Setting,
    SpanRows,
    moved_count,
    ratio,
)
from kvblend.blend.types import COMPUTE, MOVED, RowSet


def _check_layer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be an int >= 1, got {value!r} (at layer 0 a token's K/V depend on the "
            "token alone, so there is no deviation to measure)"
        )
    return value


def _deviation(name: str, value: Any) -> str:
    if value not in ("value", "key"):
        raise ValueError(f"unknown {name} metric {value!r}; choose one of value, key")
    return str(value)


def _schedule(name: str, value: Any) -> tuple[tuple[int, float], ...] | None:
    if value is None:
        return None
    schedule = tuple(tuple(step) for step in value)
    if not schedule:
        raise ValueError(f"{name} must hold at least one (layer, ratio) step")
    previous_layer, previous_ratio = -1, 1.0
    for step in schedule:
        if len(step) != 2:
            raise ValueError(f"{name} steps are (layer, ratio) pairs, got {step!r}")
        layer, share = step
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 1:
            raise ValueError(f"{name} layers must be increasing ints >= 1")
        if layer <= previous_layer:
            raise ValueError(f"{name} layers must be increasing ints >= 1")
        ratio(f"{name} ratio", share)
        if share > previous_ratio:
            raise ValueError(f"{name} ratios must not increase from step to step")
        previous_layer, previous_ratio = layer, share
    return schedule


class CacheBlendSelector(Selector):
    """Compute every moved row, then keep the most deviating ones at each check layer."""

    name = "cacheblend"
    settings = {
        "recompute_ratio": RECOMPUTE_RATIO,
        "check_layer": Setting(1, _check_layer, "layer at which the deviation is measured"),
        "deviation": Setting("value", _deviation, "projection compared: value or key"),
        "ratio_schedule": Setting(
            None, _schedule, "gradual filtering ((layer, ratio), ...), replacing the other two"
        ),
        "correction": CORRECTION,
        "stale_temperature": STALE_TEMPERATURE,
    }

    @classmethod
    def check_together(cls, values: dict[str, Any], given: Mapping[str, Any]) -> None:
        """Refuse a schedule given together with the settings it replaces."""
        if given.get("ratio_schedule") is not None:
            clash = [name for name in ("recompute_ratio", "check_layer") if name in given]
            if clash:
                raise ValueError(
                    f"ratio_schedule replaces {' and '.join(clash)}; give one or the other"
                )

    def __init__(self, settings: Mapping[str, Any]) -> None:
        super().__init__(settings)
        self.schedule: dict[int, float] = dict(
            self.options["ratio_schedule"]
            or ((self.options["check_layer"], self.options["recompute_ratio"]),)
        )
        self.refine_layers = frozenset(self.schedule)
        self.moved_total = 0
        self.uncached = 0  # computed rows that are not moved (all of them, at every layer)
        self.active = 0  # moved rows computed so far

    def check_model(self, shape: DecoderShape) -> None:
        """Refuse check layers the model does not have."""
        for layer in self.schedule:
            if layer >= shape.num_layers:
                raise ValueError(
                    f"check layer {layer} is outside the model, which has {shape.num_layers} "
                    f"layers (valid: 1..{shape.num_layers - 1})"
                )

    def forecast(self, kinds: np.ndarray, spans: Iterable[SpanRows]) -> Forecast:
        """Count the last check layer's share of the moved rows (each check keeps at most it)."""
        moved = moved_count(kinds)
        return Forecast(min(moved, round(self.schedule[max(self.schedule)] * moved)))

    def select(self, context: SelectionContext) -> Selection:
        """Compute every moved row up to the first check layer."""
        kinds = context.kinds.numpy()
        self.moved_total = self.active = int((kinds == MOVED).sum())
        self.uncached = int((kinds == COMPUTE).sum())
        return Selection(torch.from_numpy(np.flatnonzero((kinds == COMPUTE) | (kinds == MOVED))))

    def refine(
        self,
        decoder: ModelAdapter,
        layer: int,
        hidden: torch.Tensor,
        rows: RowSet,
        kinds: torch.Tensor,
        cached: tuple[torch.Tensor, torch.Tensor],
    ) -> Narrowing:
        """Keep the moved rows whose fresh K or V deviates most from the cached one."""
        # Only the compared projection runs over every computed row; the rows kept get their
        # queries, keys and values in the loop.
        use_keys = self.options["deviation"] == "key"
        fresh = decoder.project_kv(layer, hidden, keys=use_keys)
        stored = cached[0] if use_keys else cached[1]
        # summed over every tensor-parallel rank's heads, so every rank keeps the same rows
        deviation = decoder.reduce_scores((fresh.float() - stored.float()).pow(2).sum(dim=(0, 2)))
        moved = kinds.index_select(0, rows.positions) == MOVED
        # the uncached rows rank first (infinite), then the moved rows by deviation
        score = torch.where(moved, deviation, torch.full_like(deviation, float("inf")))
        self.active = min(round(self.schedule[layer] * self.moved_total), self.active)
        keep = torch.topk(score, self.uncached + self.active, sorted=False).indices.sort().values
        return Narrowing(keep, RowSet(rows.positions.index_select(0, keep)))
