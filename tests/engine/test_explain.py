"""`engine.explain` agrees with `engine.prefill`: same counts, same fallback, on many prompts.

And every fallback is visible: in the stats, once in the log per cause, never for a prompt
without documents.
"""

from __future__ import annotations

import itertools
import logging
import random

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.blend.forecast import NO_DOCUMENTS
from kvblend.blend.selectors import Fallback
from kvblend.blend.selectors import base as selectors_base
from kvblend.blend.selectors.attention import share_above
from kvblend.store import MemoryKVStore

WORDS = "alpha beta gamma delta river stone cloud maple copper violin lisbon harbor".split()


def _document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


CONFIGS = [
    BlendConfig(),
    BlendConfig(min_recompute=0),
    BlendConfig(min_recompute=0, full_above=1.0),
    BlendConfig(min_recompute=20, short_document=0, full_above=0.5),
    BlendConfig(recompute_ratio=0.0, min_recompute=0, lead_tokens=4, full_above=1.0),
    BlendConfig(recompute_ratio=1.0),
    BlendConfig("reuse"),
    BlendConfig("full"),
    BlendConfig("epic", epic_tokens=6),
    BlendConfig("cacheblend", recompute_ratio=0.3),
]


def _prompts(engine: BlendEngine) -> list[str]:
    """Prompts of 1-5 documents of 3-60 words (the byte tokenizer: a token a character)."""
    rng = random.Random(7)
    prompts = []
    for case in range(12):
        documents = [_document(rng, rng.choice((3, 8, 20, 60))) for _ in range(1 + case % 5)]
        engine.precompute(documents)
        head = "Documents:\n" if case % 3 else engine.doc_prefix or ""
        body = "\n\n".join(documents)
        if case % 4 == 1:  # one document truncated: not found
            body += "\n\n" + documents[0][: len(documents[0]) // 2]
        prompts.append(f"{head}{body}\n\nQuestion: which river?")
    return prompts


def test_explain_agrees_with_prefill_on_many_prompts(engine: BlendEngine) -> None:
    checked = fallbacks = 0
    for prompt in _prompts(engine):
        for config in CONFIGS:
            explained = engine.explain(prompt, config)
            stats = engine.prefill(prompt, config).stats
            where = f"{config} on {prompt!r}"
            assert explained.reused_tokens == stats.reused_tokens, where
            assert explained.recomputed_tokens == stats.recomputed_tokens, where
            assert explained.computed_tokens == stats.computed_tokens, where
            assert explained.fallback == stats.fallback, where
            assert explained.forecast.documents_lost == stats.documents_lost, where
            assert explained.documents_found == stats.documents_found, where
            assert explained.near_miss == stats.near_miss, where
            checked += 1
            fallbacks += stats.fallback is not None
    assert checked == 12 * len(CONFIGS)
    assert 0 < fallbacks < checked  # both sides of the budget rule were compared


def test_a_fallback_is_reported_with_its_reason_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    rng = random.Random(3)
    documents = [_document(rng, 8) for _ in range(3)]  # about 150 moved tokens
    engine.precompute(documents)
    prompt = "Documents:\n" + "\n\n".join(documents) + "\n\nQuestion: which river?"
    with caplog.at_level(logging.WARNING, logger="kvblend.engine.engine"):
        first = engine.prefill(prompt).stats  # the 256-token floor covers every moved token
        engine.prefill(prompt)
    assert first.fallback is not None and first.fallback.startswith("min_recompute")
    assert first.strategy == "attention" and first.strategy_run == "full"
    assert first.documents_found == 3 and first.documents_reused == 0
    assert len(first.documents_lost) == 3
    assert all("recomputed whole (min_recompute)" in line for line in first.documents_lost)
    assert first.to_dict()["fallback"] == first.fallback
    logged = [r.getMessage() for r in caplog.records if "min_recompute" in r.getMessage()]
    assert len(logged) == 1  # once a minute per cause and engine
    blended = engine.prefill(prompt, BlendConfig(min_recompute=0, full_above=1.0)).stats
    assert blended.fallback is None and blended.strategy_run == "attention"
    assert blended.documents_reused == 3 and not blended.documents_lost
    explained = str(engine.explain(prompt))
    assert "runs as full prefill: min_recompute" in explained  # nothing reused: none said
    assert "reused)" not in explained and first.reused_tokens == 0
    headed = engine.rag_segments("which river?", documents)  # its head is a cached prefix
    explained = engine.explain(headed)
    assert explained.reused_tokens > 0 and explained.fallback is not None
    assert f"after the cached prefix ({explained.reused_tokens} tokens reused there)" in str(
        explained
    )


def test_a_prompt_without_documents_says_so_and_warns_nothing(
    engine: BlendEngine, caplog: pytest.LogCaptureFixture
) -> None:
    engine.precompute([_document(random.Random(5), 20)])
    engine._fallback_log._last.clear()  # noqa: SLF001 - a fresh minute
    with caplog.at_level(logging.DEBUG, logger="kvblend"):
        stats = engine.prefill("Hi").stats
        engine.prefill("Given the conversation, rephrase the follow-up question: where?")
    assert [r.levelno for r in caplog.records] == [logging.INFO]  # once a minute, no warning
    assert f"no known document in the prompt ({len(engine.library.registry)} known)" in caplog.text
    assert stats.documents_found == 0 and stats.near_miss is None
    assert stats.fallback == NO_DOCUMENTS and stats.fallback.startswith("no_documents: ")
    assert stats.strategy == "attention" and stats.strategy_run == "full"
    assert stats.estimated_cost == 1.0 and stats.reused_tokens == 0
    explained = engine.explain("Hi")
    assert explained.fallback == NO_DOCUMENTS and "no_documents" in str(explained)
    assert engine.prefill("Hi", BlendConfig("full")).stats.fallback is None  # as asked


def test_reworded_fallbacks_keep_their_causes_and_are_logged_once_per_cause(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fallback's rule is decided with it, never read back from its words: every fallback
    reworded (the renderer patched, new words each time), each prefill names the same cause and
    the same documents recomputed whole, and the log warns once per cause, not per wording."""
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    rng = random.Random(3)
    documents = [_document(rng, 8) for _ in range(3)]  # about 150 moved tokens
    engine.precompute(documents)
    prompt = "Documents:\n" + "\n\n".join(documents) + "\n\nQuestion: which river?"
    one = "Documents:\n" + documents[0] + "\n\nQuestion: which river?"  # 52 moved tokens
    blends = {"min_recompute": 0, "short_document": 0, "full_above": 1.0}  # unless told
    cases = {
        "min_recompute": (prompt, BlendConfig()),
        "short_document": (prompt, BlendConfig(min_recompute=0, short_document=100)),
        "full_above": (prompt, BlendConfig(**{**blends, "full_above": 0.1})),
        "per_document": (prompt, BlendConfig(**blends, per_document=64)),
        "window": (one, BlendConfig(**blends, recompute_ratio=0.9, window=8, lead_tokens=4)),
        "guard": (prompt, BlendConfig(**blends, guard=0.0)),
        "no_documents": ("Hi", BlendConfig()),
    }
    plain = {cause: engine.prefill(text, config).stats for cause, (text, config) in cases.items()}
    for cause, stats in plain.items():
        assert stats.fallback_cause == cause and str(stats.fallback).startswith(f"{cause}: ")
        assert stats.strategy_run == "full"
    said = itertools.count()

    def reworded(fallback: Fallback) -> str:
        return f"({next(said)}) {fallback.detail.upper()}, SAYS {fallback.rule[::-1].upper()}"

    monkeypatch.setattr(selectors_base, "describe_fallback", reworded)
    engine._fallback_log._last.clear()  # noqa: SLF001 - a fresh minute
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvblend.engine.engine"):
        for _ in range(2):  # each prefill words its fallback anew
            for cause, (text, config) in cases.items():
                stats = engine.prefill(text, config).stats
                where = f"{cause}: {stats.fallback}"
                assert stats.fallback_cause == cause and stats.strategy_run == "full", where
                assert str(stats.fallback).endswith(f"SAYS {cause[::-1].upper()}"), where
                assert stats.documents_lost == plain[cause].documents_lost, where
                assert stats.recomputed_tokens == plain[cause].recomputed_tokens, where
                forecast = engine.explain(text, config).forecast
                if cause != "guard":  # the guard decides after the blend
                    assert forecast.cause == cause and forecast.fallback != stats.fallback, where
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == len(cases) - 1, warned  # a prompt without documents: INFO, once
    for cause in cases.keys() - {"no_documents"}:
        assert sum(f"SAYS {cause[::-1].upper()}" in line for line in warned) == 1, warned
    assert sum(r.levelno == logging.INFO for r in caplog.records) == 1


def test_full_above_never_prints_a_cost_equal_to_its_limit(engine: BlendEngine) -> None:
    assert share_above(0.8001, 0.8) == "0.8001" and share_above(0.8049, 0.8) == "0.805"
    assert share_above(0.86, 0.8) == "0.86" and share_above(0.800000001, 0.8) == "just above 0.8"
    seen = 0
    for prompt in _prompts(engine):
        for config in CONFIGS:
            fallback = engine.explain(prompt, config).fallback or ""
            if fallback.startswith("full_above"):
                shown = fallback.split("cost ")[1].split(" of full")[0]
                limit = float(fallback.split("(limit ")[1].rstrip(")"))
                assert float(shown.removeprefix("just above ")) >= limit, fallback
                assert shown != f"{limit:.2f}", fallback
                seen += 1
    assert seen  # the rule fired on some prompts


def test_a_question_quoting_a_reused_document_is_no_near_miss(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    document = "Marta Quill is a beekeeper who lives in Lisbon with her three dogs."
    other = "Tomas Elm makes violins in Cremona and plays them on Sundays."
    engine.precompute([document, other])
    quoting = f"What does '{document[:24]}' mean?"  # its first 16+ characters, reused too
    prompt = f"Context: {document}\n\n{other}\nQuestion: {quoting}"
    segments = engine.rag_segments(quoting, [other, document])
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        for config in (BlendConfig(), BlendConfig("reuse")):
            assert engine.prefill(prompt, config).stats.near_miss is None
            assert engine.prefill(segments, config).stats.near_miss is None
        explained = engine.explain(prompt)
    assert explained.near_miss is None and "near miss" not in str(explained)
    assert "near" not in caplog.text
    # a whole known document passed as uncached text is no truncated copy either
    uncached = [Segment("Context: ", cache=False), Segment(document, cache=False),
                Segment("\nQuestion: where?", cache=False)]  # fmt: skip
    assert engine.prefill(uncached, BlendConfig("reuse")).stats.near_miss is None


def test_a_title_echoing_a_reused_documents_start_is_no_near_miss() -> None:
    """``Document [1](Title: X) X is ...``: the label's title is the first words of the reused
    document, and another stored document starts with the same words (another version of it)."""
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    title = " Filipino American History Month"  # 32 characters, as the documents' heads
    document = f"{title} is celebrated in the United States during October each year."
    version = f"{title} was first observed in 1992 and is celebrated in October."
    other = "Tomas Elm makes violins in Cremona and plays them on Sundays."
    engine.precompute([document, version, other])
    segments = [
        Segment("Documents:\n", cache=False),
        Segment(f"Document [1](Title:{title})", cache=False),
        Segment(document),
        Segment("\nQuestion: when?", cache=False),
    ]
    prompt = "".join(segment.text for segment in segments)  # fmt: skip
    for given in (segments, prompt):
        stats = engine.prefill(given, BlendConfig("reuse")).stats
        assert stats.documents_reused == 1 and stats.near_miss is None, stats.near_miss
    # a truncated copy of another document, beside the reused one, is still named
    stats = engine.prefill(f"{prompt}\nAlso: {other[:40]}", BlendConfig("reuse")).stats
    assert stats.near_miss is not None and f"of {len(other)} characters" in stats.near_miss


def test_a_truncated_document_in_a_segment_list_is_a_near_miss() -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    document = "Marta Quill is a beekeeper who lives in Lisbon with her three dogs."
    engine.precompute([document])
    segments = engine.segments_for(f"Context: {document[:40]}\nQuestion: where?")
    stats = engine.prefill(segments, BlendConfig("reuse")).stats
    assert stats.near_miss is not None and "starts at character 9" in stats.near_miss


def test_a_truncated_document_is_named_as_a_near_miss() -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    document = "Marta Quill is a beekeeper who lives in Lisbon with her three dogs."
    engine.precompute([document])
    prompt = f"Context: {document[:40]}\nQuestion: where?"
    stats = engine.prefill(prompt, BlendConfig("reuse")).stats
    assert stats.documents_found == 0
    assert stats.near_miss is not None and "starts at character 9" in stats.near_miss
    assert "near miss" in str(engine.explain(prompt))
