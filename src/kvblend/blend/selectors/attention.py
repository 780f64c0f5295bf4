"""``attention``: recompute the reused tokens the question draws most from.

A probe pass computes the question's tail (the text after the last document; with ``probe_tail``
off, every uncached token, as ``reuse`` would) over the reused KV and measures,
at every layer, how much each token contributes to the attention output of the prompt's uncached
tail (the question and the template text after it: `tail_attention`), summed over heads and queries,
over the first ``probe_layers`` of the layers (all by default; fewer let the prefill start before
every layer's cached KV has arrived). The top ``recompute_ratio`` of the moved tokens by that score
are recomputed at every layer; with ``early_layers``, a funnel recomputes the top ``early_ratio`` in
the first layers and narrows to ``recompute_ratio`` after them (the rows that leave are read from
the cache again). The probe's KV (reused rows in place, already rotated) is the prefill's starting
point, so the cached KV is loaded and rotated once. The chosen rows stay on the device (a ``topk``
of a count the host knows, sorted there): the prefill starts without reading them back.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.guard import GUARD_SIGNALS, RISK_SIGNAL
from kvblend.blend.selectors.base import (
    STALE_TEMPERATURE,
    Fallback,
    Forecast,
    Narrowing,
    Selection,
    SelectionContext,
    Selector,
    Setting,
    SpanRows,
    chosen_rows,
    flag,
    non_negative_int,
    ratio,
    tolerance,
)
from kvblend.blend.selectors.ranking import (
    UnitBudget,
    Units,
    candidate_runs,
    ranked_units,
    unit_budget,
    units_of,
)
from kvblend.blend.selectors.tail_attention import TailAttention, tail_rows
from kvblend.blend.types import COMPUTE, MOVED, RowSet, to_device

__all__ = ["AttentionSelector", "attention_budget"]


def leading_rows(context: SelectionContext, count: int, short: int = 0) -> np.ndarray:
    """Boolean ``[tokens]`` (host): the first ``count`` rows of every moved span.

    Every row of a moved span of at most ``short`` rows.
    """
    lead = np.zeros(context.kinds.numel(), dtype=bool)
    for span in context.spans:
        if span.kind == MOVED:
            rows = span.end - span.start if span.end - span.start <= short else count
            lead[span.start : min(span.end, span.start + rows)] = True
    return lead


#: The attention strategy's correction: stronger than the other strategies' (`CORRECTION`), as
#: it recomputes each moved document's own top rows (``per_document``), whose mean K/V change
#: stands for the document's other rows better than a shared budget's few picks do (chosen on
#: the calibration questions, docs/benchmarks.md, "How to choose").
ATTENTION_CORRECTION = Setting(
    0.75,
    ratio,
    "share of the mean K/V change of a document's recomputed tokens added to its other tokens",
)

#: The guard's default tolerance (`kvblend.blend.guard`): None until calibrated.
GUARD_TOLERANCE: float | None = None

#: Cost of a row read from a cache relative to a computed row (loading, rotating and attending
#: over it) and the blend loop's fixed cost in rows, fitted to the TTFTs of the shapes
#: benchmark on CPU (docs/configuration.md, "When a blend computes the whole prompt").
REUSED_ROW_COST = 0.23
BLEND_OVERHEAD_ROWS = 27


@dataclass(frozen=True)
class AttentionBudget:
    """The attention strategy's decision for one prompt, from its token kinds alone.

    ``lead``: moved rows recomputed as leading rows (whole short documents included);
    ``keep``: moved rows the probe picks on top, recomputed at every layer; ``early``: moved
    rows the probe picks for the early layers (``keep`` and more: the funnel's top);
    ``probe``: rows the probe pass computes (0: none); ``recompute_all``: every moved row is
    recomputed (the blend reads no moved row); ``cost``: the blend's estimated cost as a share
    of a full prefill's; ``fallback``: why every moved row is recomputed, None when the blend
    runs as asked.
    """

    lead: int
    keep: int
    early: int
    probe: int
    recompute_all: bool
    cost: float
    fallback: Fallback | None

    @property
    def recomputed(self) -> int:
        """Moved rows recomputed at every layer (every one when ``recompute_all``)."""
        return self.lead + self.keep


def attention_budget(
    kinds: Sequence[int] | np.ndarray, spans: Iterable[SpanRows], options: dict[str, Any]
) -> AttentionBudget:
    """Decide how many moved rows the attention strategy recomputes, and whether to blend.

    A pure function of the prompt's token kinds and cached spans: `AttentionSelector.select` and
    `AttentionSelector.forecast` both call it, so what ``explain`` reports is what runs. The blend's
    cost is its computed rows (uncached, leading, chosen, the funnel's extra rows for its share of
    the layers, and the probe's for its share of them) plus `REUSED_ROW_COST` per row read from a
    cache and `BLEND_OVERHEAD_ROWS`, over a full prefill's rows (a prediction of the blend's TTFT as
    a share of full prefill's); above ``full_above`` every moved row is recomputed (the prompt head
    stays reused in place).
    """
    spans = list(spans)
    kinds = np.asarray(kinds)  # counted in numpy: no loop over tokens
    moved = int(np.count_nonzero(kinds == MOVED))
    uncached = int(np.count_nonzero(kinds == COMPUTE))
    lead = _lead_count(kinds, spans, options)
    candidates = moved - lead
    keep, early = _chosen_counts(options, moved, lead, candidates)
    selectable, units = candidates, None  # the rows the probe ranks (in blocks: the full ones)
    if keep < candidates and (options["window"] > 1 or options["per_document"] > 0):
        runs = candidate_runs(kinds, spans, options["lead_tokens"], options["short_document"])
        units = unit_budget((run.size for run in runs), keep, early, options["window"],
                            options["per_document"])  # fmt: skip
        keep, early, selectable = units.keep, units.early, units.selectable
    probe = _probe_count(kinds, options, uncached, keep, early, selectable)
    cost = _blend_cost(options, kinds.size, uncached, lead, (keep, early), probe)
    reason = _fallback(options, moved, lead, keep == candidates, units, cost)
    if keep == candidates or reason is not None:  # every moved row: no probe
        return AttentionBudget(lead, candidates, candidates, 0, True, cost, reason)
    return AttentionBudget(lead, keep, early, probe, False, cost, reason)


def _lead_count(kinds: np.ndarray, spans: list[SpanRows], options: dict[str, Any]) -> int:
    """Return the moved rows recomputed as leading rows: each moved span's first ``lead_tokens``.

    Every row of a moved span of at most ``short_document`` rows.
    """
    is_moved = kinds == MOVED
    lead_count, short = options["lead_tokens"], options["short_document"]
    lead = 0
    for span in spans:
        if span.kind == MOVED:
            rows = span.end - span.start if span.end - span.start <= short else lead_count
            lead += int(np.count_nonzero(is_moved[span.start : min(span.end, span.start + rows)]))
    return lead


def _chosen_counts(
    options: dict[str, Any], moved: int, lead: int, candidates: int
) -> tuple[int, int]:
    """Return the probe's picks on top of the leading rows: at every layer, in the early ones.

    ``recompute_ratio`` of the moved rows with ``min_recompute`` as a floor (leading rows
    included); the funnel's ``early_ratio``, at least as many; neither more than the
    ``candidates``.
    """
    share = round(options["recompute_ratio"] * moved)
    keep = min(max(share, options["min_recompute"] - lead), candidates)
    early = keep
    if options["early_layers"] > 0:
        early = min(max(round(options["early_ratio"] * moved), keep), candidates)
    return keep, early


def _probe_count(
    kinds: np.ndarray,
    options: dict[str, Any],
    uncached: int,
    keep: int,
    early: int,
    selectable: int,
) -> int:
    """Return the rows the probe pass computes (0: none, nothing to rank).

    The uncached rows (the question's tail alone with ``probe_tail``), when some of the
    ``selectable`` rows are picked and some are not, through every layer or the early ones.
    """
    probe = uncached if 0 < keep < selectable or 0 < early < selectable else 0
    if probe and options["probe_tail"]:  # the probe computes the question's tail alone
        probe = tail_rows(kinds).size
    return probe


def _blend_cost(
    options: dict[str, Any],
    total: int,
    uncached: int,
    lead: int,
    chosen: tuple[int, int],
    probe: int,
) -> float:
    """Return the blend's estimated cost as a share of a full prefill's (`attention_budget`).

    ``chosen``: the probe's picks through every layer and through the early ones.
    """
    keep, early = chosen
    cached = total - uncached - lead - keep
    funnel = (early - keep) * options["early_layers"]
    probed = probe * options["probe_layers"]
    rows = uncached + lead + keep + funnel + probed + REUSED_ROW_COST * cached + BLEND_OVERHEAD_ROWS
    return rows / max(total, 1)


def _fallback(
    options: dict[str, Any],
    moved: int,
    lead: int,
    covered: bool,
    units: UnitBudget | None,
    cost: float,
) -> Fallback | None:
    """Why every moved row is recomputed instead of blending, None when the blend runs.

    ``covered``: the budget takes every candidate row (`_covered_reason` says which rule made
    it); otherwise, or for a ``recompute_ratio`` of 1, a cost above ``full_above``.
    """
    if not moved:
        return None
    reason = _covered_reason(options, moved, lead, units) if covered else None
    limit = options["full_above"]
    if reason is None and limit < 1 and cost > limit:
        share = share_above(cost, limit)
        return Fallback("full_above", f"blend would cost {share} of full prefill (limit {limit:g})")
    return reason


def _covered_reason(
    options: dict[str, Any], moved: int, lead: int, units: UnitBudget | None
) -> Fallback | None:
    """Which rule makes the budget cover every moved row (None: ``recompute_ratio`` of 1)."""
    if units is not None:  # the rows became blocks or minima that cover every row
        if units.minimum + lead == moved:
            return Fallback(
                "per_document",
                f"{options['per_document']} tokens of each moved document cover all {moved} "
                "moved tokens",
            )
        return Fallback(
            "window",
            f"the budget in whole blocks of {options['window']} tokens covers all {moved} "
            "moved tokens",
        )
    if options["recompute_ratio"] >= 1:
        return None
    if lead == moved:
        short = options["short_document"]
        return Fallback("short_document", f"every moved document has at most {short} tokens")
    return Fallback(
        "min_recompute",
        f"the floor of {options['min_recompute']} tokens covers all {moved} moved tokens",
    )


def share_above(cost: float, limit: float) -> str:
    """Write ``cost`` (above ``limit``) with as many digits as it takes to read as above it.

    Never ``0.80`` for a limit of 0.8: 2 to 6 decimals, else ``just above 0.8``.
    """
    for digits in range(2, 7):
        text = f"{cost:.{digits}f}"
        if float(text) > limit:
            return text
    return f"just above {limit:g}"


def early_layer_count(share: float, num_layers: int) -> int:
    """How many first layers compute the funnel's top (``early_layers`` of ``num_layers``).

    At least one when ``share`` > 0, and never every layer.
    """
    if share <= 0:
        return 0
    return min(max(1, round(share * num_layers)), num_layers - 1)


def probe_layer_count(share: float, num_layers: int) -> int:
    """How many first layers the probe runs (``probe_layers`` of ``num_layers``, at least one)."""
    return min(max(1, round(share * num_layers)), num_layers)


def _layer_share(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a share of the model's layers in [0, 1), got {value!r}")
    return float(value)


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _probe_share(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{name} must be a share of the model's layers in (0, 1], got {value!r}")
    return float(value)


def _guard_signal(name: str, value: Any) -> str:
    if value not in GUARD_SIGNALS:
        raise ValueError(f"{name} must be one of {', '.join(GUARD_SIGNALS)}, got {value!r}")
    return str(value)


def ranked_candidates(score: torch.Tensor, candidates: np.ndarray, count: int) -> torch.Tensor:
    """Return the ``count`` entries of ``candidates`` scoring most, best first (on device)."""
    rows = to_device(candidates, score.device)
    if count <= 0:
        return rows[:0]
    return rows[torch.topk(score[rows], min(count, rows.numel()), sorted=True).indices]


def stale_share(
    scores: torch.Tensor, moved: np.ndarray, candidates: np.ndarray, ranked: torch.Tensor,
    keep: int,
) -> torch.Tensor:  # fmt: skip
    """Return the share of the probe's scores of the moved rows left stale (on the device).

    ``ranked``: the chosen candidates, best first, of which the first ``keep`` are recomputed
    through every layer.
    """
    device = scores.device
    total = scores[to_device(moved, device)].sum()
    stale = scores[to_device(candidates, device)].sum() - scores[ranked[:keep]].sum()
    return stale / total.clamp(min=1e-30)


class AttentionSelector(Selector):
    """Recompute the moved tokens the probe's tail attention ranks first.

    The top ``recompute_ratio`` of moved tokens are recomputed at every layer. With
    ``early_layers`` (a share of the model's layers, 0 by default), the first layers recompute
    the top ``early_ratio`` instead, a funnel narrowing to ``recompute_ratio`` after them: the
    early layers are where a document's tokens most need the text they were cached without,
    and rows leaving the funnel keep what those layers gave the rows that stay.

    ``min_recompute`` sets a floor under ``recompute_ratio``'s budget, the leading rows below
    included: a prompt of few moved tokens (five retrieved passages) gets a larger share of them
    recomputed, while a long prompt, whose share is larger than the floor, keeps the ratio.

    With ``lead_tokens``, the first tokens of every moved document are recomputed too (they
    saw only the document head when cached and act as the document's attention sink; a short
    document's answer depends on them most), on top of the ratio's budget.

    ``window`` (1 by default) ranks blocks of that many consecutive candidate rows of a document
    by their summed score and recomputes whole blocks, the budget rounded up to whole blocks;
    ``per_document`` (16 by default) gives every moved document its own top rows first (blocks
    with ``window``), the rest of the budget going to the top of all (`ranking`).

    ``probe_layers`` (a share of the model's layers, all by default) runs the probe over the
    first layers only: it costs less, and on a GPU the prefill starts while the later layers'
    cached KV is still being copied (the copies of every layer are issued as the probe starts).

    When the blend's estimated cost (`attention_budget`: its computed rows, probe included,
    plus the rows it reads from caches at `REUSED_ROW_COST` each) is above ``full_above`` of a
    full prefill's, every moved token is recomputed instead: such a blend is barely faster
    than full prefill, and the rows it leaves stale still cost quality.
    """

    name = "attention"
    settings = {
        "recompute_ratio": Setting(
            0.3, ratio, "share of the moved tokens recomputed at every layer, in [0, 1]"
        ),
        "early_ratio": Setting(
            0.4, ratio, "share of the moved tokens recomputed in the early layers, in [0, 1]"
        ),
        "early_layers": Setting(
            0.0, _layer_share, "share of the model's layers that recompute early_ratio (0: none)"
        ),
        "probe_layers": Setting(
            1.0, _probe_share, "share of the model's layers (the first ones) the probe runs"
        ),
        "min_recompute": Setting(
            256, non_negative_int, "moved tokens recomputed at least, leading ones included"
        ),
        "window": Setting(
            1,
            _positive_int,
            "the probe ranks blocks of this many consecutive moved tokens (summed scores) and "
            "recomputes whole blocks (1: single tokens)",
        ),
        "per_document": Setting(
            16,
            non_negative_int,
            "each moved document's top tokens recomputed first, the rest of the budget going to "
            "the top of all (0: none)",
        ),
        "lead_tokens": Setting(8, non_negative_int, "leading tokens of each moved document"),
        "short_document": Setting(
            32, non_negative_int, "moved documents of at most this many tokens are recomputed whole"
        ),
        "full_above": Setting(
            0.8,
            ratio,
            "estimated cost (of full prefill) above which every moved token is "
            "recomputed (1: never)",
        ),
        "correction": ATTENTION_CORRECTION,
        "stale_temperature": STALE_TEMPERATURE,
        "probe_tail": Setting(
            True,
            flag,
            "the probe computes only the question's tail (the text after the last document); "
            "the text between documents is left out of its attention",
        ),
        "guard": Setting(
            GUARD_TOLERANCE,
            tolerance,
            "the tolerance on guard_signal past which the prompt is computed in full after the "
            "blend (None: no guard; inf: the signals recorded, never computed in full)",
        ),
        "guard_signal": Setting(
            RISK_SIGNAL,
            _guard_signal,
            "the guard's signal: shift (total variation from the cached prompt's next-token "
            "distribution), kl, flip or stale_mass escalate above the tolerance, margin (top-1 "
            "minus top-2 probability) below it",
        ),
    }
    refine_reads_cache = False  # the funnel narrows to rows chosen before the loop

    def __init__(self, settings: Mapping[str, Any]) -> None:
        super().__init__(settings)
        self.later: Narrowing | None = None  # the rows kept after the early layers

    def forecast(self, kinds: np.ndarray, spans: Iterable[SpanRows]) -> Forecast:
        """Count the budget rule's rows (`attention_budget`): leading and chosen, or all."""
        budget = attention_budget(kinds, spans, self.options)
        moved = int(np.count_nonzero(np.asarray(kinds) == MOVED))
        recomputed = moved if budget.recompute_all else budget.recomputed
        lead, short = self.options["lead_tokens"], self.options["short_document"]
        # the probe's rows through its layers, the funnel's extra rows through the early ones
        partial = (budget.probe * self.options["probe_layers"]
                   + (budget.early - budget.keep) * self.options["early_layers"])  # fmt: skip
        return Forecast(recomputed, budget.cost, budget.fallback, lead, short, partial)

    def select(self, context: SelectionContext) -> Selection:
        """Run the probe and pick the moved rows scoring most (`attention_budget` says how many)."""
        # Every count here is on the host (numpy): the decision costs no device sync.
        kinds = context.kinds.numpy()
        budget = attention_budget(kinds.tolist(), context.spans, self.options)
        self.budget = budget
        self.refine_layers = frozenset()
        uncached = context.uncached.numpy()
        lead = leading_rows(context, self.options["lead_tokens"], self.options["short_document"])
        computed = uncached | lead
        moved = context.moved.numpy()
        if budget.recompute_all:  # every moved row: no probe
            computed[moved] = True
            return Selection(torch.from_numpy(np.flatnonzero(computed)))
        candidates = moved[~lead[moved]]  # moved rows not recomputed already
        units = self.units(context)
        selectable = candidates if units is None else units.flat  # the rows the probe ranks
        num_layers = context.decoder.shape.num_layers
        if not budget.probe:  # nothing to rank (no row, or every row, early; none later)
            return self.host_selection(computed, selectable[: budget.early], context.decoder)
        tail = tail_rows(kinds)
        probe_rows = tail if self.options["probe_tail"] else np.flatnonzero(uncached)
        observer = TailAttention(context.decoder, probe_rows, tail, kinds.size)
        layers = probe_layer_count(self.options["probe_layers"], num_layers)
        guarded = self.guard_tolerance is not None and layers == num_layers
        start = context.run_pass(
            torch.from_numpy(probe_rows), observer, layers if layers < num_layers else None,
            logits=guarded,
        )  # fmt: skip
        # summed over every tensor-parallel rank's heads, so every rank picks the same rows
        self.scores = scores = context.decoder.reduce_scores(observer.scores)
        # the chosen rows, best first, stay on the device: no read-back
        if units is None:
            ranked = ranked_candidates(scores, candidates, budget.early)
        else:  # whole blocks, each document's first stage first
            ranked = ranked_units(scores, units, budget.early)
        if guarded:  # the probe's answer, and the question's reading left stale
            assert start.logits is not None
            self.guard_inputs = (start.logits, stale_share(scores, moved, candidates, ranked,
                                                           budget.keep))  # fmt: skip
        base = np.flatnonzero(computed)
        rows = chosen_rows(base, ranked, selectable, context.decoder.device)
        layers = early_layer_count(self.options["early_layers"], num_layers)
        if budget.early > budget.keep and layers:  # the funnel narrows after the early layers
            later = chosen_rows(base, ranked[: budget.keep], selectable, rows.positions.device)
            keep = torch.searchsorted(rows.positions, later.positions)
            self.later = Narrowing(keep, later)
            self.refine_layers = frozenset([layers])
        return Selection(rows, start=start)

    def units(self, context: SelectionContext) -> Units | None:
        """Return the candidates in blocks of ``window`` with each document's first stage, or None.

        None: single rows and no minimum (the plain ranking).
        """
        if self.options["window"] == 1 and self.options["per_document"] == 0:
            return None
        runs = candidate_runs(context.kinds.numpy(), context.spans, self.options["lead_tokens"],
                              self.options["short_document"])  # fmt: skip
        return units_of(runs, self.options["window"], self.options["per_document"])

    def host_selection(
        self, computed: np.ndarray, early: np.ndarray, decoder: ModelAdapter
    ) -> Selection:
        """Select ``computed`` and the ``early`` rows, known on the host: no probe ranks them.

        With a funnel that keeps none of them (``budget.keep`` 0), the early rows leave after
        the early layers.
        """
        base = np.flatnonzero(computed)
        computed[early] = True
        positions = np.flatnonzero(computed)
        layers = early_layer_count(self.options["early_layers"], decoder.shape.num_layers)
        if self.budget.early > self.budget.keep and layers:  # every row early, none later
            stay = np.searchsorted(positions, base)
            self.later = Narrowing(stay, RowSet.from_host(base, decoder.device))
            self.refine_layers = frozenset([layers])
        return Selection(torch.from_numpy(positions))

    def refine(
        self,
        decoder: ModelAdapter,
        layer: int,
        hidden: torch.Tensor,
        rows: RowSet,
        kinds: torch.Tensor,
        cached: tuple[torch.Tensor, torch.Tensor],
    ) -> Narrowing:
        """After the early layers, keep the rows of ``recompute_ratio`` (chosen in `select`)."""
        assert self.later is not None
        return self.later
