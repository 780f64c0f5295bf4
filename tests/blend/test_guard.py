"""The blend's guard (its signals, its decision, its escalation) and the probe's text rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.blend import forecast as forecast_module
from kvblend.blend.forecast import Lost
from kvblend.blend.guard import GUARD_SIGNALS, guard_report, guard_signals
from kvblend.blend.selectors.attention import attention_budget
from kvblend.blend.selectors.tail_attention import tail_rows
from kvblend.store import MemoryKVStore

DOCUMENTS = [
    "Ann lives in Lisbon and paints boats on weekends.",
    "Bo works at Acme Co. as an engineer of small bridges.",
    "Cy is a painter who lives in Oslo and keeps a small boat too.",
]


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute(DOCUMENTS)
    return engine


def prompt() -> list[Segment]:
    """Labels between the documents (computed text), the documents moved, a question."""
    segments: list[Segment] = [Segment("Records:\n", role="prefix")]
    for number, text in enumerate(reversed(DOCUMENTS), start=1):
        segments += [Segment(f"[{number}] ", cache=False), Segment(text)]
    return [*segments, Segment("\nWho lives in Oslo?", cache=False)]


BLEND = BlendConfig(recompute_ratio=0.3, min_recompute=0, lead_tokens=2, short_document=0,
                    full_above=1.0, probe_tail=False)  # fmt: skip


def test_signals_are_zero_for_the_same_distribution_and_see_a_changed_one() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])

    def signals(probe: torch.Tensor, mass: float) -> dict[str, float]:
        values = guard_signals(probe, logits, torch.tensor(mass)).tolist()
        return dict(zip(GUARD_SIGNALS, values, strict=True))

    same = signals(logits, 0.25)
    assert same["shift"] == pytest.approx(0, abs=1e-6) and same["kl"] == pytest.approx(0, abs=1e-6)
    assert same["flip"] == 0 and same["stale_mass"] == pytest.approx(0.25)
    p = torch.softmax(logits, 0)
    assert same["margin"] == pytest.approx(float(p[0] - p[1]))
    moved = signals(logits.flip(0), 0.0)
    assert moved["flip"] == 1
    assert moved["shift"] == pytest.approx(float((p - p.flip(0)).abs().sum() / 2))
    assert moved["kl"] > 0


def test_the_report_escalates_above_the_tolerance_only() -> None:
    values = [0.2, 0.1, 0.0, 0.5, 0.3]
    kept = guard_report(values, 0.25)
    assert not kept.escalated and kept.reason is None and kept.risk == pytest.approx(0.2)
    sent = guard_report(values, 0.1)
    assert sent.escalated and "0.200" in str(sent.reason) and "limit 0.1" in str(sent.reason)
    assert sent.to_dict()["signals"]["margin"] == pytest.approx(0.5)


def test_the_guard_setting_takes_a_tolerance_or_none() -> None:
    assert BlendConfig().guard is None or BlendConfig().guard >= 0
    assert BlendConfig(guard=0.2).guard == 0.2 and BlendConfig(guard="off").guard is None
    assert BlendConfig(guard=math.inf).guard == math.inf
    for bad in (-0.1, "high", True):
        with pytest.raises(ValueError, match="guard"):
            BlendConfig(guard=bad)
    with pytest.raises(ValueError, match="guard"):
        BlendConfig("epic", guard=0.1)


def test_a_guarded_blend_reports_its_signals_and_escalates_to_full_prefill(
    engine: BlendEngine,
) -> None:
    full = engine.prefill(prompt(), BlendConfig("full"))
    off = engine.prefill(prompt(), BLEND.replace(guard=None))
    assert off.stats.guard is None and not off.stats.escalated
    watched = engine.prefill(prompt(), BLEND.replace(guard=math.inf))  # signals, no escalation
    assert torch.equal(watched.logits, off.logits)  # the guard changes nothing it does not escalate
    report = watched.stats.guard
    assert (
        report is not None
        and not report["escalated"]
        and set(report["signals"]) == set(GUARD_SIGNALS)
    )
    assert 0 <= report["signals"]["stale_mass"] <= 1 and report["risk"] > 0
    escalated = engine.prefill(prompt(), BLEND.replace(guard=0.0))
    stats = escalated.stats
    assert stats.escalated and stats.strategy_run == "full" and stats.fallback.startswith("guard:")
    assert stats.recomputed_tokens == stats.moved_tokens and stats.documents_reused == 0
    assert stats.documents_lost == [f"document {n}: recomputed whole (guard)" for n in (1, 2, 3)]
    # the blend's work and the whole prompt's: more than a full prefill's, less than both
    assert 1 < stats.compute_fraction < 1 + watched.stats.compute_fraction
    assert torch.allclose(escalated.logits, full.logits, atol=1e-4, rtol=0)
    out = engine.generate(prompt(), BLEND.replace(guard=0.0), max_new_tokens=3)
    assert out.text == engine.generate(prompt(), BlendConfig("full"), max_new_tokens=3).text


def test_no_guard_where_the_prompt_is_computed_in_full_anyway(engine: BlendEngine) -> None:
    whole = engine.prefill(prompt(), BlendConfig(guard=0.0))  # the floor covers every moved row
    assert whole.stats.fallback.startswith("min_recompute") and whole.stats.guard is None


def test_probe_tail_probes_the_question_alone_and_computes_less(engine: BlendEngine) -> None:
    plain = engine.prefill(prompt(), BLEND)
    tail = engine.prefill(prompt(), BLEND.replace(probe_tail=True))
    assert tail.stats.recomputed_tokens == plain.stats.recomputed_tokens
    plan = engine.plan(prompt())
    kinds = np.asarray(plan.kinds)
    layers = engine.decoder.shape.num_layers
    uncached, question = int((kinds == 2).sum()), tail_rows(kinds).size  # COMPUTE = 2
    saved = (plain.stats.compute_fraction - tail.stats.compute_fraction) * kinds.size * layers
    assert saved == pytest.approx((uncached - question) * layers)  # the probe's text rows
    cheaper = attention_budget(kinds, plan.spans, BLEND.replace(probe_tail=True).settings)
    assert cheaper.cost < attention_budget(kinds, plan.spans, BLEND.settings).cost
    assert torch.isfinite(tail.logits).all()
    # the text the probe leaves out is read as zeros, with or without the correction
    bare = engine.prefill(prompt(), BLEND.replace(probe_tail=True, correction=0.0))
    assert torch.isfinite(bare.logits).all()


def test_explain_says_the_blend_is_guarded(engine: BlendEngine) -> None:
    assert "guarded (tolerance 0.1)" in str(engine.explain(prompt(), BLEND.replace(guard=0.1)))
    margin = str(engine.explain(prompt(), BLEND.replace(guard=0.1, guard_signal="margin")))
    assert "guarded (tolerance 0.1): computed in full after the blend if its most likely" in margin
    assert "guarded" not in str(engine.explain(prompt(), BLEND.replace(guard=None)))


def test_reworded_lost_documents_leave_the_escalation_as_it_was(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The escalation merges the forecast's lost documents by their records, not their words:
    every line reworded (the renderer patched), the same documents are listed, in order."""
    shortest = min(len(engine.tokenize(text)) for text in DOCUMENTS)
    config = BLEND.replace(short_document=shortest, guard=0.0)  # one document recomputed whole
    forecast = engine.explain(prompt(), config).forecast
    assert forecast.fallback is None and [item.recomputed for item in forecast.lost] == [True]
    plain = engine.prefill(prompt(), config).stats
    assert plain.documents_lost == [f"document {n}: recomputed whole (guard)" for n in (1, 2, 3)]

    def reworded(lost: Lost) -> str:
        return f"#{lost.document} {'whole' if lost.recomputed else 'skipped'} because {lost.reason}"

    monkeypatch.setattr(forecast_module, "describe_lost", reworded)
    short = forecast.lost[0]
    assert engine.explain(prompt(), config).forecast.documents_lost == [
        f"#{short.document} whole because {short.reason}"
    ]
    stats = engine.prefill(prompt(), config).stats
    assert stats.escalated and stats.strategy_run == "full" and stats.fallback == plain.fallback
    assert stats.documents_lost == [f"#{n} whole because guard" for n in (1, 2, 3)]
    assert stats.recomputed_tokens == plain.recomputed_tokens == stats.moved_tokens


def test_a_margin_guard_escalates_below_its_tolerance_and_says_so() -> None:
    values = [0.2, 0.1, 0.0, 0.5, 0.3]  # shift, kl, flip, margin, stale_mass
    sent = guard_report(values, 0.6, "margin")
    assert sent.escalated and sent.signal == "margin" and sent.risk == pytest.approx(0.5)
    assert "leads the second by only 0.500" in str(sent.reason) and "limit 0.6" in str(sent.reason)
    assert not guard_report(values, 0.4, "margin").escalated
    assert not guard_report(values, 0.5, "margin").escalated  # at the tolerance: kept
    assert guard_report(values, 0.1, "stale_mass").escalated
    assert not guard_report(values, 0.3, "stale_mass").escalated
    assert guard_report(values, 0.05, "kl").reason.startswith("the blend's next-token distribution")
    for signal in GUARD_SIGNALS:  # an infinite tolerance records, whatever the signal
        assert not guard_report(values, math.inf, signal).escalated
    assert guard_report(values, 0.1).to_dict()["signal"] == "shift"  # the default


def test_the_guard_signal_setting_names_a_signal() -> None:
    assert BlendConfig().guard_signal == "shift"
    assert BlendConfig(guard=0.2, guard_signal="margin").guard_signal == "margin"
    for bad in ("entropy", 1, None):
        with pytest.raises(ValueError, match="guard_signal"):
            BlendConfig(guard=0.2, guard_signal=bad)
    with pytest.raises(ValueError, match="guard_signal"):
        BlendConfig("epic", guard_signal="margin")


def test_a_margin_guard_escalates_the_near_ties(engine: BlendEngine) -> None:
    """The margin compared is the blend's own (softmax of its logits, top two); a tolerance above
    it escalates to full prefill, one at or below it keeps the blend."""
    off = engine.prefill(prompt(), BLEND.replace(guard=None))
    probs = torch.softmax(off.logits.double(), dim=-1).sort(descending=True).values
    margin = float(probs[0] - probs[1])
    watched = engine.prefill(prompt(), BLEND.replace(guard=math.inf, guard_signal="margin"))
    report = watched.stats.guard
    assert report is not None and report["signal"] == "margin" and not report["escalated"]
    assert report["risk"] == pytest.approx(margin, abs=1e-6)
    assert torch.equal(watched.logits, off.logits)
    kept = engine.prefill(prompt(), BLEND.replace(guard=margin / 2, guard_signal="margin"))
    assert not kept.stats.escalated and torch.equal(kept.logits, off.logits)
    sent = engine.prefill(prompt(), BLEND.replace(guard=margin * 2 + 1e-6, guard_signal="margin"))
    assert sent.stats.escalated and sent.stats.fallback.startswith("guard: the blend's most likely")
    full = engine.prefill(prompt(), BlendConfig("full"))
    assert torch.allclose(sent.logits, full.logits, atol=1e-4, rtol=0)
