"""Admission: blend a planned request, or leave it to vLLM's own prefill, and why.

One seam between the scheduler side's mechanism and its policy: an `Admission` decides, for a
request's plan, whether the connector blends it (`Decision`, with the reason when it does not
and the forecasts it went by), and is fed what the server observes (`Calibrated`, `StepTimed`,
`BlendTimed`). Two implementations:

- `AlwaysBlend` (``when: "always"``): blend whenever the strategy's own rules allow; nothing is
  forecast, nothing needs calibrating (the tests use it on prompts too short to win).
- `ByCost` (``when: "faster"``, the default): blend only when the blend is forecast to reach the
  first token sooner than vLLM's own prefill on this machine, by the cost model's margin
  (`costs.CostModel`), whatever else the server is doing. The cost model learns vLLM's speed
  from the start-up calibration and from the prompts vLLM prefills anyway, never by handing it
  a prompt a blend is forecast to win: learning costs no waiting user anything. A request may
  ask for ``"always"`` on such a server (its forecasts are still recorded).

A prompt no blend can win (even one computing no row, `ByCost.screen`) is not planned at all.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvblend.vllm.costs import CostModel, Forecast, blend_features
from kvblend.vllm.fallbacks import VLLM_FASTER, RequestFallback
from kvblend.vllm.request_plan import RequestPlan

logger = logging.getLogger("kvblend.vllm")

__all__ = [
    "Admission",
    "AlwaysBlend",
    "BlendTimed",
    "ByCost",
    "Calibrated",
    "Decision",
    "Observation",
    "StepTimed",
    "admission",
]

#: Calibration points: (features, seconds) of each run.
Points = list[tuple[list[float], float]]


@dataclass(frozen=True)
class Decision:
    """Blend a request or not; why not (``reason``: None when it blends); the forecasts."""

    blend: bool
    reason: RequestFallback | None = None
    forecast: Forecast | None = None


@dataclass(frozen=True)
class Calibrated:
    """The workers' start-up calibration: vLLM's forward and the blend loop, timed."""

    vllm: Points
    blend: Points


@dataclass(frozen=True)
class StepTimed:
    """One engine step's forward: its features (`costs.step_features`) and seconds."""

    features: list[float]
    seconds: float


@dataclass(frozen=True)
class BlendTimed:
    """One blend's own time (its slices, not its waits): ``rows`` computed of ``total``."""

    rows: int
    total: int
    seconds: float


Observation = Calibrated | StepTimed | BlendTimed


class Admission(Protocol):
    """Decides blend or vLLM's prefill for a plan, with its reason and forecast."""

    @property
    def ready(self) -> bool:
        """Whether it can decide (calibrated, when it needs to be)."""
        ...

    def screen(self, total: int, start: int, when: str) -> Decision | None:
        """Decide a prompt before it is planned, when no blend of it can win (None: plan it).

        ``total`` prompt tokens, ``start`` of them in vLLM's prefix cache.
        """
        ...

    def decide(self, plan: RequestPlan, when: str) -> Decision:
        """Blend ``plan`` (one the strategy's rules let blend) or leave it to vLLM."""
        ...

    def observe(self, observation: Observation) -> None:
        """Take what the server observed."""
        ...


class AlwaysBlend:
    """Blend whatever the strategy's rules allow; no forecast."""

    ready = True

    def screen(self, total: int, start: int, when: str) -> Decision | None:
        """Never: every prompt is planned."""
        return None

    def decide(self, plan: RequestPlan, when: str) -> Decision:
        """Blend."""
        return Decision(True)

    def observe(self, observation: Observation) -> None:
        """Nothing to learn."""


class ByCost:
    """Blend when forecast faster than vLLM's own prefill (`CostModel`), by its margin."""

    def __init__(self, costs: CostModel | None = None) -> None:
        self.costs = costs if costs is not None else CostModel()

    @property
    def ready(self) -> bool:
        """Whether the start-up calibration has arrived."""
        return self.costs.calibrated

    def screen(self, total: int, start: int, when: str) -> Decision | None:
        """Leave to vLLM a prompt that even a blend computing no row would lose.

        Planning decodes and tokenizes the whole prompt and finds its documents (a few
        milliseconds of the engine's scheduling step); a prompt whose uncached tail is short
        enough for vLLM's prefill to beat any blend (vLLM's prefix cache holds most of it, a
        short prompt) skips it.
        """
        if when != "faster" or not self.costs.calibrated or total - 1 <= start:
            return None  # planning says why in a word when vLLM's cache holds it all
        bound = self.costs.bound(total, start)
        if bound.blend_wins:
            return None
        words = (
            f"vllm_faster: vLLM's prefill is forecast at {bound.vllm_s:.2f} s, any blend at "
            f"{bound.blend_s:.2f} s or more (not planned)"
        )
        return Decision(False, RequestFallback(VLLM_FASTER, words), bound)

    def decide(self, plan: RequestPlan, when: str) -> Decision:
        """Blend when forecast under the margin of vLLM's prefill (always, for ``"always"``)."""
        if not self.costs.calibrated:
            return Decision(True)
        forecast = self.costs.forecast(plan.total, plan.start, plan.rows)
        if when != "faster" or forecast.blend_wins:
            return Decision(True, None, forecast)
        words = (
            f"vllm_faster: vLLM's prefill is forecast at {forecast.vllm_s:.2f} s, a blend at "
            f"{forecast.blend_s:.2f} s (a blend must be forecast under {forecast.margin:g} of "
            "vLLM's)"
        )
        return Decision(False, RequestFallback(VLLM_FASTER, words), forecast)

    def observe(self, observation: Observation) -> None:
        """Calibrate on the start-up points; correct each path by its observed runs."""
        costs = self.costs
        if isinstance(observation, StepTimed):
            costs.observe(costs.vllm, np.asarray(observation.features), observation.seconds)
        elif isinstance(observation, BlendTimed):
            features = blend_features(observation.rows, observation.total)
            costs.observe(costs.blend, features, observation.seconds)
        elif not costs.calibrated:
            self._calibrate(observation)

    def _calibrate(self, calibration: Calibrated) -> None:
        given = {"vllm": calibration.vllm, "blend": calibration.blend}
        points = {
            name: [(np.asarray(x, dtype=float), float(y)) for x, y in runs]
            for name, runs in given.items()
        }
        if not points["vllm"] or not points["blend"]:
            return
        self.costs.calibrate(points["vllm"], points["blend"])
        example = self.costs.forecast(4096, 0, 1100)
        measured = "; ".join(
            f"{name} " + ", ".join(f"{int(x[1])} rows {y:.2f} s" for x, y in points[name])
            for name in ("vllm", "blend")
        )
        logger.info(
            "kvblend: cost model calibrated on this machine (%s): a 4096-token prompt, vLLM's "
            "prefill %.2f s, a blend computing 1100 rows %.2f s",
            measured,
            example.vllm_s,
            example.blend_s,
        )


def admission(when: str, costs: CostModel | None = None) -> Admission:
    """Return the server's admission policy for its ``when`` setting."""
    return AlwaysBlend() if when == "always" else ByCost(costs)
