"""How long a blend and vLLM's own prefill take on this machine, forecast per request.

The scheduler side blends a request only when its blend is forecast to reach the first token
sooner than vLLM's own prefill would. Both forecasts are linear models of a few features of the
work, in seconds:

- vLLM's prefill of ``n`` tokens after a prefix-cache hit of ``p`` (`vllm_features`): a fixed
  cost, ``n`` (projections and MLP, per row) and ``n * (p + n / 2)`` (causal attention, per
  query and key pair);
- a blend of a ``total``-token prompt that computes ``rows`` rows, summed over its passes
  (`blend_features`): a fixed cost, ``rows``, ``rows * total`` (each computed row attends over
  the whole prompt) and ``total`` (every row's K/V read, rotated, written into vLLM's cache),
  plus the step that computes the last prompt token once the blend is done.

The worker side calibrates both at start-up (`calibrate`: vLLM's own forward and the blend loop
over a few synthetic prompts, interleaved, on the model and the cores that will serve) and then
reports every engine step's forward time with its tokens, and every blend's time with its rows;
each `LinearFit` keeps its calibrated weights and corrects its scale by what it observed lately.
A machine that gets slower (another job takes a core) moves both forecasts within a few steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CostModel", "Forecast", "LinearFit", "blend_features", "vllm_features"]

#: Scale of the quadratic features (token pairs), so every weight is of a similar size.
PAIRS = 1e-6


def vllm_features(tokens: float, prefix: float) -> np.ndarray:
    """Features of a vLLM forward computing ``tokens`` rows after ``prefix`` cached ones."""
    return np.array([1.0, tokens, tokens * (prefix + tokens / 2) * PAIRS])


def step_features(rows: list[tuple[int, int]]) -> np.ndarray:
    """Features of one engine step: ``(tokens, prefix)`` of each request it computes."""
    total = np.zeros(3)
    for tokens, prefix in rows:
        total += vllm_features(tokens, prefix)
    total[0] = 1.0  # one step: one fixed cost
    return total


def blend_features(rows: float, total: float) -> np.ndarray:
    """Features of a blend computing ``rows`` rows (all passes) of a ``total``-token prompt."""
    return np.array([1.0, rows, rows * total * PAIRS, total])


class LinearFit:
    """A linear model of seconds, ``w . features``, and how far off it has lately been.

    The weights come from the start-up calibration (`fit_points`: non-negative least squares,
    each point weighted by its relative error, so short and long runs count alike); every
    observation then updates a correction factor, the ratio of the seconds observed to the
    seconds forecast over the recent observations (each older one fading by ``forget``), so
    longer runs count more. A machine that gets slower (another job takes a core) moves the
    forecasts within a few observations, while the calibration keeps their shape.
    """

    def __init__(self, size: int, forget: float = 0.9) -> None:
        self.size = size
        self.forget = forget
        self.weights = np.zeros(size)
        self._observed = 1.0  # seconds observed, fading
        self._forecast = 1.0  # seconds forecast for the same observations, fading
        self.observed = 0

    @property
    def correction(self) -> float:
        """Seconds observed per second forecast, lately."""
        return self._observed / self._forecast

    def set_prior(self, weights: np.ndarray) -> None:
        """Set the weights (the calibration)."""
        self.weights = np.clip(np.asarray(weights, dtype=float), 0.0, None)

    def fit_points(self, points: list[tuple[np.ndarray, float]]) -> np.ndarray:
        """Return the non-negative least-squares weights of ``points`` (the calibration)."""
        features = np.array([x for x, _ in points], dtype=float)
        seconds = np.array([y for _, y in points], dtype=float)
        scale = 1.0 / np.maximum(seconds, 1e-3)
        return _nnls(features * scale[:, None], seconds * scale)

    def observe(self, features: np.ndarray, seconds: float) -> None:
        """Take one observation into the correction."""
        forecast = float(self.weights @ features)
        if not np.isfinite(seconds) or seconds <= 0 or forecast <= 0:
            return
        if self.observed == 0:  # the first one replaces the neutral start
            self._observed, self._forecast = 0.0, 0.0
        self._observed = self.forget * self._observed + seconds
        self._forecast = self.forget * self._forecast + forecast
        self.observed += 1

    def predict(self, features: np.ndarray) -> float:
        """Forecast seconds for ``features``."""
        return float(self.weights @ features) * self.correction


def _nnls(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Non-negative least squares by active set elimination (a few features: exact enough)."""
    active = np.ones(matrix.shape[1], dtype=bool)
    weights = np.zeros(matrix.shape[1])
    for _ in range(matrix.shape[1]):
        if not active.any():
            break
        solved = np.linalg.lstsq(matrix[:, active], target, rcond=None)[0]
        weights = np.zeros(matrix.shape[1])
        weights[active] = solved
        if (solved >= 0).all():
            return weights
        worst = np.flatnonzero(active)[int(np.argmin(solved))]
        active[worst] = False
    return np.clip(weights, 0.0, None)


@dataclass(frozen=True)
class Forecast:
    """The two forecasts of one request, in seconds, and the choice they make."""

    blend_s: float
    vllm_s: float

    @property
    def blend_wins(self) -> bool:
        """Whether the blend is forecast to finish first."""
        return self.blend_s < self.vllm_s

    def as_record(self) -> dict[str, float]:
        """Return the forecasts as a response carries them."""
        return {
            "forecast_blend_s": round(self.blend_s, 3),
            "forecast_vllm_s": round(self.vllm_s, 3),
        }


class CostModel:
    """The scheduler side's forecasts: one `LinearFit` for vLLM's forward, one for the blend."""

    def __init__(self) -> None:
        self.vllm = LinearFit(3)
        self.blend = LinearFit(4)
        self.calibrated = False

    def calibrate(
        self,
        vllm_points: list[tuple[np.ndarray, float]],
        blend_points: list[tuple[np.ndarray, float]],
    ) -> None:
        """Set both priors from the start-up measurements."""
        self.vllm.set_prior(self.vllm.fit_points(vllm_points))
        self.blend.set_prior(self.blend.fit_points(blend_points))
        self.calibrated = True

    def forecast(self, total: int, start: int, rows: int) -> Forecast:
        """Forecast a ``total``-token prompt with a prefix-cache hit of ``start`` tokens.

        vLLM computes ``total - start`` tokens; the blend computes ``rows`` rows over its
        passes, then vLLM's forward computes the last prompt token.
        """
        own = self.vllm.predict(vllm_features(total - start, start))
        last = self.vllm.predict(vllm_features(1, total - 1))
        blend = self.blend.predict(blend_features(rows, total)) + last
        return Forecast(blend, own)
