"""`blend_plan`: one path from a prefill plan to blended K/V, read lazily or whole.

The engine reads a plan's entries lazily (a missing one computed and stored, one failing while
read recomputed); the vLLM connector's worker reads them whole before the loop (an unusable
one's rows computed in full, listed as lost, nothing stored), with tensor-parallel ranks
agreeing on the entries they use. Both ways give the same K/V when every entry is intact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.blend.forecast import Lost
from kvblend.blend.types import COMPUTE
from kvblend.documents.blend_plan import blend_plan
from kvblend.prompt.plan import PrefillPlan
from kvblend.prompt.segments import segment_key
from kvblend.store import MemoryKVStore

DOCS = [
    "Marta Quill lives in Lisbon and keeps bees on the roof.",
    "The orange cat sleeps all day near the window sill.",
    "A meeting at 9:30 in room 12, then lunch by the river.",
]
CONFIG = BlendConfig("reuse")


@pytest.fixture
def engine() -> BlendEngine:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute(DOCS, progress=False)
    engine.prefill(engine.rag_segments("?", DOCS), CONFIG)  # stores the template head's KV too
    return engine


def plan_of(engine: BlendEngine) -> PrefillPlan:
    plan = engine.plan(engine.rag_segments("Where does Marta live?", [DOCS[2], DOCS[0], DOCS[1]]))
    assert len(plan.spans) == 4  # the template head and three documents
    return plan


def key_of(engine: BlendEngine, plan: PrefillPlan, index: int) -> str:
    span = plan.spans[index]
    return segment_key(engine.library.segment_kv.fingerprint, span.context_ids, span.cached_ids)


class TwoRanks:
    """Tensor-parallel ranks where the other rank could not read the first entry."""

    tp_size = 2

    def __init__(self, kv_heads: int) -> None:
        self.kv_heads = slice(0, kv_heads)

    def gather_ranks(self, values: torch.Tensor) -> torch.Tensor:
        other = values.clone()
        other[0] = 0
        return torch.stack((values, other))


def test_lazy_and_whole_reads_give_the_same_kv(engine: BlendEngine) -> None:
    plan = plan_of(engine)
    planned = plan.kinds.copy()
    lazy = blend_plan(engine.decoder, engine.library.segment_kv, plan, CONFIG.selector())
    lost: list[Lost] = []
    whole = blend_plan(
        engine.decoder,
        engine.library.segment_kv,
        plan,
        CONFIG.selector(),
        read_whole=True,
        lost=lost,
    )
    assert lazy.computed == whole.computed == 0 and not lost
    assert len(lazy.spans) == len(whole.spans) == 4
    assert np.array_equal(lazy.kinds, planned) and np.array_equal(whole.kinds, planned)
    assert lazy.out.logits is not None and whole.out.logits is not None
    assert torch.equal(lazy.out.logits, whole.out.logits)
    pairs = zip(lazy.out.keys + lazy.out.values, whole.out.keys + whole.out.values, strict=True)
    for a, b in pairs:
        assert torch.equal(a, b)
    assert np.array_equal(plan.kinds, planned)  # the plan stays as planned


def test_a_missing_entry_is_computed_and_stored_when_read_lazily(engine: BlendEngine) -> None:
    plan = plan_of(engine)
    key = key_of(engine, plan, 2)
    engine.store.delete(key)
    blended = blend_plan(engine.decoder, engine.library.segment_kv, plan, CONFIG.selector())
    assert blended.computed == 1 and len(blended.spans) == 4
    assert engine.store.contains(key)
    assert np.array_equal(blended.kinds, plan.kinds)


def test_a_missing_entry_read_whole_has_its_rows_computed(engine: BlendEngine) -> None:
    plan = plan_of(engine)
    key = key_of(engine, plan, 2)
    engine.store.delete(key)
    lost: list[Lost] = []
    blended = blend_plan(
        engine.decoder,
        engine.library.segment_kv,
        plan,
        CONFIG.selector(),
        read_whole=True,
        lost=lost,
    )
    assert lost == [Lost("not in the store", key=key)]
    assert [str(entry) for entry in lost] == [f"entry {key[:12]} not in the store"]
    assert blended.computed == 0 and len(blended.spans) == 3
    assert not engine.store.contains(key)  # vLLM stores it after its step
    span = plan.spans[2]
    assert (blended.kinds[span.start : span.end] == COMPUTE).all()
    assert (plan.kinds[span.start : span.end] != COMPUTE).all()


def test_an_entry_failing_while_read_lazily_is_recomputed(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_of(engine)
    segment_kv = engine.library.segment_kv
    real = segment_kv.open_entry
    failing = key_of(engine, plan, 1)

    class Unreadable(dict[str, torch.Tensor]):
        def __getitem__(self, name: str) -> torch.Tensor:
            raise OSError("the remote tier went away")

    def open_entry(key: str, tokens: int, device: Any = None) -> Any:
        return Unreadable() if key == failing else real(key, tokens, device)

    monkeypatch.setattr(segment_kv, "open_entry", open_entry)
    blended = blend_plan(engine.decoder, segment_kv, plan, CONFIG.selector())
    assert blended.computed == 1 and segment_kv.dropped == 1
    assert [bool(getattr(span.source, "recomputed", None)) for span in blended.spans] == [
        False, True, False, False,
    ]  # fmt: skip


def test_ranks_agree_on_the_entries_they_use(engine: BlendEngine) -> None:
    plan = plan_of(engine)
    ranks = TwoRanks(engine.decoder.shape.num_kv_heads)
    lost: list[Lost] = []
    blended = blend_plan(
        engine.decoder,
        engine.library.segment_kv,
        plan,
        CONFIG.selector(),
        read_whole=True,
        ranks=ranks,
        lost=lost,
    )
    key = key_of(engine, plan, 0)
    assert [str(entry) for entry in lost] == [
        f"entry {key[:12]} unusable on another tensor-parallel rank"
    ]
    assert len(blended.spans) == 3
    head = plan.spans[0]
    assert (blended.kinds[head.start : head.end] == COMPUTE).all()


def test_a_rank_never_recomputes_an_entry_alone(
    engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = plan_of(engine)
    segment_kv = engine.library.segment_kv
    wrong = {"kv": torch.zeros(1, 2, 3)}  # a store that ignores the expected shape
    monkeypatch.setattr(segment_kv, "open_entry", lambda key, tokens, device=None: wrong)

    class OneRankOfTwo(TwoRanks):
        def gather_ranks(self, values: torch.Tensor) -> torch.Tensor:
            return torch.stack((values, values))

    ranks = OneRankOfTwo(engine.decoder.shape.num_kv_heads)
    with pytest.raises(RuntimeError, match="cannot recompute"):
        blend_plan(
            engine.decoder, segment_kv, plan, CONFIG.selector(), read_whole=True, ranks=ranks
        )
    blended = blend_plan(engine.decoder, segment_kv, plan, CONFIG.selector(), read_whole=True)
    assert blended.computed == 4  # one process: each entry recomputed (and stored again)
