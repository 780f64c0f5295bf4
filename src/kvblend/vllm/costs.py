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
over a few synthetic prompts, on the model and the cores that will serve) and then reports every
engine step's forward time with its tokens, and every blend's time with its rows; `LinearFit`
refits each model on what it observed, recent observations counting most, the calibration as
its prior. A machine that gets slower (another job takes a core) moves both forecasts within a
few steps.
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
    """Least squares of ``seconds ~ w . features`` with forgetting and a prior.

    Each observation is weighted by its relative error (``1 / seconds**2``), so short and long
    requests count alike; older observations fade by ``forget`` per new one; the prior (the
    start-up calibration, as ``prior_weight`` observations) keeps the fit defined while the
    observations span few shapes. Weights are kept non-negative.
    """

    def __init__(self, size: int, forget: float = 0.97, prior_weight: float = 4.0) -> None:
        self.size = size
        self.forget = forget
        self.prior_weight = prior_weight
        self.prior = np.zeros(size)
        self._gram = np.zeros((size, size))
        self._moment = np.zeros(size)
        self.weights = np.zeros(size)
        self.observed = 0

    def set_prior(self, weights: np.ndarray) -> None:
        """Set the prior weights (the calibration) and refit."""
        self.prior = np.clip(np.asarray(weights, dtype=float), 0.0, None)
        self._solve()

    def fit_points(self, points: list[tuple[np.ndarray, float]]) -> np.ndarray:
        """Return the non-negative least-squares weights of ``points`` alone (calibration)."""
        features = np.array([x for x, _ in points], dtype=float)
        seconds = np.array([y for _, y in points], dtype=float)
        scale = 1.0 / np.maximum(seconds, 1e-3)
        weights = _nnls(features * scale[:, None], seconds * scale)
        return weights

    def observe(self, features: np.ndarray, seconds: float) -> None:
        """Add one observation and refit."""
        if not np.isfinite(seconds) or seconds <= 0:
            return
        scale = 1.0 / max(seconds, 1e-3) ** 2
        self._gram = self.forget * self._gram + scale * np.outer(features, features)
        self._moment = self.forget * self._moment + scale * seconds * features
        self.observed += 1
        self._solve()

    def _solve(self) -> None:
        # the prior acts as observations of each weight at its prior value, relative to it
        prior = np.where(self.prior > 0, self.prior, 1.0)
        ridge = np.diag(self.prior_weight / prior**2)
        gram = self._gram + ridge
        moment = self._moment + ridge @ self.prior
        try:
            weights = np.linalg.solve(gram, moment)
        except np.linalg.LinAlgError:
            weights = self.prior.copy()
        if (weights < 0).any():  # keep each weight non-negative: refit without the negatives
            keep = weights > 0
            weights = np.zeros(self.size)
            if keep.any():
                sub = np.ix_(keep, keep)
                weights[keep] = np.linalg.lstsq(gram[sub], moment[keep], rcond=None)[0]
            weights = np.clip(weights, 0.0, None)
        self.weights = np.asarray(weights, dtype=float)

    def predict(self, features: np.ndarray) -> float:
        """Forecast seconds for ``features``."""
        return float(self.weights @ features)


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
