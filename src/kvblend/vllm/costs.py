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

The worker side calibrates both at start-up (`calibration`: vLLM's own forward and the blend
loop over a few synthetic prompts, interleaved, on the model and the cores that will serve; the
blend's rows cost a multiple of vLLM's cost of computing them, `CostModel.blend_weights`) and
then reports every engine step's forward time with its tokens, and every blend's own time (its
slices, not the steps between them nor its wait behind other blends) with its rows;
`CostModel` keeps the calibrated shapes and learns, per path, how far its recent runs were from
them (another job taking a core moves that path's forecasts within a few runs). vLLM's path is
learnt from the prompts vLLM prefills anyway (no stored document, too short, a chat's next
turn, mostly in its prefix cache): never from a prompt a blend is forecast to win.
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
    """A linear model of seconds, ``w . features``, and how far off its own runs have been.

    The weights come from the start-up calibration (`fit_points`: non-negative least squares,
    each point weighted by its relative error, so short and long runs count alike). `residual`
    is the ratio of the seconds observed to those the calibration forecasts over this model's
    own recent runs, older ones fading by ``forget``, longer ones counting more; it starts at 1
    as if `PRIOR_S` seconds had agreed.
    """

    PRIOR_S = 1.0
    #: One run counts as at most this many times its forecast (and at least its forecast over
    #: it): a run slowed by something outside the server (a machine out of memory took one 7.5K
    #: blend to 668 s against a 7 s forecast) moves the residual as a 4x slower run would, so a
    #: single outlier cannot turn the server away from a path for long; runs steadily slower
    #: (a busy machine) still move it all the way.
    MAX_RATIO = 4.0
    #: Without runs, the residual fades back toward 1 (the calibration) with this half-life:
    #: a path not chosen for a while is forecast afresh, so an unlucky stretch cannot rule it out
    #: for good.
    HALF_LIFE_S = 300.0

    def __init__(
        self, size: int, forget: float = 0.8, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.size = size
        self.forget = forget
        self.clock = clock
        self.weights = np.zeros(size)
        self._observed = self._forecast = self.PRIOR_S
        self._at = clock()
        self.observed = 0

    @property
    def residual(self) -> float:
        """Seconds observed per second forecast, over this model's own recent runs."""
        fade = 0.5 ** ((self.clock() - self._at) / self.HALF_LIFE_S)
        return 1.0 + (self._observed / self._forecast - 1.0) * fade

    def set_prior(self, weights: np.ndarray) -> None:
        """Set the weights (the calibration)."""
        self.weights = np.clip(np.asarray(weights, dtype=float), 0.0, None)

    def fit_points(self, points: list[tuple[np.ndarray, float]]) -> np.ndarray:
        """Return the non-negative least-squares weights of ``points`` (the calibration)."""
        features = np.array([x for x, _ in points], dtype=float)
        seconds = np.array([y for _, y in points], dtype=float)
        scale = 1.0 / np.maximum(seconds, 1e-3)
        return _nnls(features * scale[:, None], seconds * scale)

    def base(self, features: np.ndarray) -> float:
        """Seconds the calibration alone forecasts for ``features``."""
        return float(self.weights @ features)

    def take(self, forecast: float, seconds: float) -> None:
        """Take one run into the residual: ``seconds`` observed, ``forecast`` expected.

        ``seconds`` counts as at most `MAX_RATIO` times ``forecast`` (at least its inverse).
        """
        seconds = min(max(seconds, forecast / self.MAX_RATIO), forecast * self.MAX_RATIO)
        residual = self.residual  # faded: the sums restart from it
        self._observed = self.forget * residual * self._forecast + seconds
        self._forecast = self.forget * self._forecast + forecast
        self._at = self.clock()
        self.observed += 1


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
    margin: float = 1.0  # the blend must be forecast at most this share of vLLM's prefill

    @property
    def blend_wins(self) -> bool:
        """Whether the blend is forecast to finish first, by the margin."""
        return self.blend_s < self.margin * self.vllm_s

    def as_record(self) -> dict[str, float]:
        """Return the forecasts as a response carries them."""
        return {
            "forecast_blend_s": round(self.blend_s, 3),
            "forecast_vllm_s": round(self.vllm_s, 3),
        }


class CostModel:
    """The scheduler side's forecasts: one `LinearFit` each for vLLM's forward and the blend.

    A forecast is a model's calibrated seconds times that model's own `LinearFit.residual`,
    learnt from its own runs only. The two paths do not slow down alike on a busy machine: on
    this project's 2 cores shared with other jobs, vLLM's prefill kept its speed while the
    blend loop (many small torch ops, each a parallel region whose threads all wait for the
    slowest) ran up to 2-4 times slower than calibrated; so neither path's runs move the other's
    forecast. A path that is not chosen is not observed: its correction fades back to its
    calibration (`LinearFit.HALF_LIFE_S`), and a blend must be forecast faster by `MARGIN`
    before it is chosen, so that an unsure choice is vLLM's prefill, never slower than vLLM
    itself. Steps of fewer than `MIN_TOKENS` tokens (decodes, the last prompt token after a
    blend) or shorter than `MIN_S` say too little about a prefill and are left out. ``clock``:
    the time the corrections fade with (tests pass a fake one).
    """

    MIN_TOKENS = 32
    MIN_S = 0.02
    MARGIN = 0.8

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.vllm = LinearFit(3, clock=clock)
        self.blend = LinearFit(4, clock=clock)
        self.calibrated = False

    def calibrate(
        self,
        vllm_points: list[tuple[np.ndarray, float]],
        blend_points: list[tuple[np.ndarray, float]],
    ) -> None:
        """Set both models' weights from the start-up measurements."""
        self.vllm.set_prior(self.vllm.fit_points(vllm_points))
        self.blend.set_prior(self.blend_weights(blend_points))
        self.calibrated = True

    def blend_weights(self, points: list[tuple[np.ndarray, float]]) -> np.ndarray:
        """Return the blend's weights: its rows at a multiple of vLLM's cost of computing them.

        A blend computes its rows with the same projections, MLP and attention as vLLM's
        forward (through its own kernels), so its cost per row and per query-key pair keep the
        ratio vLLM's calibration found, scaled by one factor; with a fixed cost and a cost per
        prompt token (rows read, moved, written) that is three weights for the calibration's
        four blends, each fitted by least squares. Four free weights fitted on four points a
        loaded machine timed fit their noise: on this project's 2 shared cores such a fit kept
        the attention term alone and forecast 4K blends at 0.92-0.97 of vLLM's prefill (they
        take 0.6 of it). Without a vLLM cost per row, the four weights are fitted freely.
        """
        per_row, per_pair = self.vllm.weights[1], self.vllm.weights[2]
        if per_row <= 0 and per_pair <= 0:
            return self.blend.fit_points(points)
        reduced = [
            (np.array([x[0], per_row * x[1] + per_pair * x[2], x[3]]), seconds)
            for x, seconds in points
        ]
        fixed, scale, per_token = self.blend.fit_points(reduced)
        return np.array([fixed, scale * per_row, scale * per_pair, per_token])

    def predict(self, model: LinearFit, features: np.ndarray) -> float:
        """Forecast seconds of ``features`` on ``model``'s path."""
        return model.base(features) * model.residual

    def observe(self, model: LinearFit, features: np.ndarray, seconds: float) -> None:
        """Take one observed run of ``model``'s path into its residual."""
        base = model.base(features)
        too_small = model is self.vllm and features[1] < self.MIN_TOKENS
        if too_small or not np.isfinite(seconds) or seconds < self.MIN_S or base <= 0:
            return
        model.take(base, seconds)

    def bound(self, total: int, start: int) -> Forecast:
        """Forecast vLLM's prefill and the least any blend of the prompt can take (no rows).

        A blend reads, moves and writes every row and then waits for the last prompt token's
        step, whatever it computes: when even that loses, the request needs no plan.
        """
        return self.forecast(total, start, 0)

    def forecast(self, total: int, start: int, rows: int) -> Forecast:
        """Forecast a ``total``-token prompt with a prefix-cache hit of ``start`` tokens.

        vLLM computes ``total - start`` tokens; the blend computes ``rows`` rows over its
        passes, then vLLM's forward computes the last prompt token.
        """
        own = self.predict(self.vllm, vllm_features(total - start, start))
        last = self.predict(self.vllm, vllm_features(1, total - 1))
        blend = self.predict(self.blend, blend_features(rows, total)) + last
        return Forecast(blend, own, self.MARGIN)
