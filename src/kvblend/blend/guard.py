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

The risk is ``shift`` (`RISK_SIGNAL`); the guard escalates when it is above the tolerance
(``BlendConfig(guard=...)``): the prompt is computed in full (every moved row recomputed, the
prompt head still read in place), and the result says so (`GuardReport`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["GUARD_SIGNALS", "RISK_SIGNAL", "GuardReport", "guard_signals", "guard_report"]

#: The signals, in the order of `guard_signals`' tensor.
GUARD_SIGNALS = ("shift", "kl", "flip", "margin", "stale_mass")
#: The signal the tolerance is compared with.
RISK_SIGNAL = "shift"


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
    top = torch.topk(p, 2).values
    flip = (probe.argmax() != blend.argmax()).float()
    return torch.stack((shift, kl, flip, top[0] - top[1], stale_mass.float().reshape(())))


@dataclass
class GuardReport:
    """What the guard saw and did on one prefill (``BlendStats.guard``, as a dict).

    ``escalated``: the prompt was computed in full after the blend; ``reason``: why, in words
    (None when it was not); ``risk``: the signal compared with ``tolerance``; ``signals``:
    every signal (`GUARD_SIGNALS`).
    """

    tolerance: float
    risk: float
    escalated: bool
    reason: str | None = None
    signals: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Return the report as plain JSON-ready values."""
        return asdict(self)


def guard_report(values: list[float], tolerance: float) -> GuardReport:
    """Decide from the signals read back (`guard_signals`' values) whether to escalate."""
    signals = dict(zip(GUARD_SIGNALS, (float(v) for v in values), strict=True))
    risk = signals[RISK_SIGNAL]
    escalated = risk > tolerance
    reason = None
    if escalated:
        reason = (
            f"the blend moved the next-token distribution by {risk:.3f} from the cached "
            f"prompt's (limit {tolerance:g}): computed in full"
        )
    return GuardReport(tolerance, risk, escalated, reason, signals)
