"""The blend's guard: from what a blend computes anyway, how far its answer may be from full's.

A blend of the ``attention`` strategy runs a probe pass first: the prompt's uncached rows (the
question among them, the last token included) over the reused K/V exactly as cached, which is
what ``reuse`` computes. Its last row's next-token distribution is almost free (one row through
the last layer and the LM head), and it is the answer the prompt would get with nothing
recomputed. The blend then recomputes the rows the question reads most. When recomputing moved
the next-token distribution a long way from the probe's, the cached K/V was far from what the
prompt needs, and the rows left stale are likely to move it further: the blend's answer is at
risk. Signals, all made on the device from tensors the blend has (no host read before the
logits), then read once, with the rows the statistics read anyway:

- ``shift``: total variation distance between the probe's and the blend's next-token
  distributions (half the L1 distance: 0 = the same, 1 = disjoint);
- ``kl``: KL(blend || probe) in nats;
- ``flip``: 1 when the most likely next token changed between the probe and the blend;
- ``margin``: the blend's probability of its most likely token minus that of the second (a
  near-tie is where a small error changes the answer);
- ``stale_mass``: the share of the probe's attention score (the question's reading of the moved
  rows) on the moved rows the blend left stale.

The signal compared with the tolerance (``BlendConfig(guard=..., guard_signal=...)``) is
``shift`` by default (`RISK_SIGNAL`). A high value means risk for every signal but ``margin``,
where a low one does (`LOW_IS_RISK`): the guard escalates when the signal is above the tolerance,
or for ``margin`` below it. An infinite tolerance records the signals and never escalates,
whatever the signal. Escalated, the prompt is computed in full (every moved row recomputed, the
prompt head still read in place), and the result says so (`GuardReport`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = [
    "GUARD_SIGNALS",
    "LOW_IS_RISK",
    "RISK_SIGNAL",
    "GuardReport",
    "at_risk",
    "guard_report",
    "guard_signals",
    "top_margin",
]

#: The signals, in the order of `guard_signals`' tensor.
GUARD_SIGNALS = ("shift", "kl", "flip", "margin", "stale_mass")
#: The signal the tolerance is compared with by default (``guard_signal``).
RISK_SIGNAL = "shift"
#: Signals where a low value means risk (the guard escalates below the tolerance).
LOW_IS_RISK = frozenset({"margin"})


def guard_signals(
    probe_logits: torch.Tensor, logits: torch.Tensor, stale_mass: torch.Tensor
) -> torch.Tensor:
    """Return the guard's signals ``[len(GUARD_SIGNALS)]`` (float32, on the device): no read.

    ``probe_logits``: the probe pass's next-token logits (the prompt as cached); ``logits``:
    the blend's; ``stale_mass``: the share of the probe's scores on the rows left stale.
    """
    blend = torch.log_softmax(logits.float(), dim=-1)
    probe = torch.log_softmax(probe_logits.float(), dim=-1)
    p = blend.exp()
    shift = 0.5 * (p - probe.exp()).abs().sum()
    kl = (p * (blend - probe)).sum().clamp(min=0)
    flip = (probe.argmax() != blend.argmax()).float()
    return torch.stack((shift, kl, flip, top_margin(p, probs=True), stale_mass.float().reshape(())))


def top_margin(scores: torch.Tensor, probs: bool = False) -> torch.Tensor:
    """Return the most likely token's probability minus the second's, over the last dim.

    ``scores``: logits (``probs=True``: probabilities already); the result keeps the leading
    dims, on the device (no read).
    """
    p = scores.float() if probs else torch.softmax(scores.float(), dim=-1)
    top = torch.topk(p, 2, dim=-1).values
    return top[..., 0] - top[..., 1]


def at_risk(signal: str, value: float, tolerance: float) -> bool:
    """Whether ``signal``'s ``value`` is on the risky side of ``tolerance`` (`LOW_IS_RISK`).

    Never with an infinite tolerance (the signals recorded only).
    """
    if not math.isfinite(tolerance):
        return False
    return value < tolerance if signal in LOW_IS_RISK else value > tolerance


@dataclass
class GuardReport:
    """What the guard saw and did on one prefill (``BlendStats.guard``, as a dict).

    ``escalated``: the prompt was computed in full after the blend; ``reason``: why, in words
    (None when it was not); ``risk``: the value of ``signal`` (`GUARD_SIGNALS`) compared with
    ``tolerance`` (above it is risk, or below it for a signal of `LOW_IS_RISK`); ``signals``:
    every signal.
    """

    tolerance: float
    risk: float
    escalated: bool
    reason: str | None = None
    signals: dict[str, float] = field(default_factory=dict)
    signal: str = RISK_SIGNAL

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain JSON-ready values."""
        return asdict(self)


def guard_report(values: list[float], tolerance: float, signal: str = RISK_SIGNAL) -> GuardReport:
    """Decide from the signals read back (`guard_signals`' values) whether to escalate.

    ``signal``: the one compared with ``tolerance`` (`at_risk`).
    """
    signals = dict(zip(GUARD_SIGNALS, (float(v) for v in values), strict=True))
    risk = signals[signal]
    escalated = at_risk(signal, risk, tolerance)
    reason = None
    if escalated:
        reason = f"{_REASONS[signal].format(risk)} (limit {tolerance:g}): computed in full"
    return GuardReport(tolerance, risk, escalated, reason, signals, signal)


#: What each signal says when it escalates, its value formatted in.
_REASONS = {
    "shift": "the blend moved the next-token distribution by {:.3f} from the cached prompt's",
    "kl": "the blend's next-token distribution is {:.3f} nats (KL) from the cached prompt's",
    "flip": "the blend changed the cached prompt's most likely next token ({:.0f})",
    "margin": "the blend's most likely next token leads the second by only {:.3f} of probability",
    "stale_mass": "the rows the blend left stale hold {:.3f} of the question's probe scores",
}
