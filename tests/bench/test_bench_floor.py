"""The rounding floor: bfloat16 full prefill (emulated or native), the rounded references in
`kvblend bench nq`, agreement over leading words and the figures as multiples of the floor."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import byte_tokenizer, tiny_model
from conftest_langchain import requires_rag_stack
from kvblend import BlendConfig, BlendEngine
from kvblend.bench.quality.closeness import closeness, closeness_table, floor_ratios, same_words
from kvblend.bench.quality.nq import Passage, nq_segments
from kvblend.bench.quality.nq_eval import RunOptions, run_decided
from kvblend.bench.quality.qa_bench import kl_divergence
from kvblend.bench.quality.rounding import Bfloat16Products, RoundedPrefill, rounded_products
from kvblend.bench.strategies import FLOOR, parse_strategies, strategy
from kvblend.store import MemoryKVStore

PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the wall. " * 3


def test_emulated_products_are_float32_products_of_bfloat16_values_rounded() -> None:
    torch.manual_seed(0)
    x, w, b = (torch.randn(*shape).to(torch.bfloat16) for shape in ((7, 64), (48, 64), (48,)))
    with Bfloat16Products() as mode:
        out = F.linear(x, w, b)
        scores = x @ x.T
    assert out.dtype == scores.dtype == torch.bfloat16 and mode.products == 2
    assert torch.equal(out, F.linear(x.float(), w.float(), b.float()).to(torch.bfloat16))
    assert torch.equal(scores, (x.float() @ x.float().T).to(torch.bfloat16))
    with Bfloat16Products() as mode:  # float32 work is left alone
        F.linear(x.float(), w.float())
    assert mode.products == 0
    with pytest.raises(ValueError, match="unknown rounding"):
        with rounded_products("fp8"):
            pass


def _engine(family: str = "llama") -> BlendEngine:
    return BlendEngine(tiny_model(family), byte_tokenizer(), store=MemoryKVStore(), name="t")


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_rounded_prefill_is_bfloat16_full_prefill_in_the_engine_dtype(family: str) -> None:
    engine = _engine(family)
    exact = engine.prefill(PROMPT, BlendConfig("full"))
    native, emulated = RoundedPrefill(engine, "native"), RoundedPrefill(engine, "emulated")
    ours, theirs = emulated.prefill(PROMPT), native.prefill(PROMPT)
    assert ours.token_ids == exact.token_ids == theirs.token_ids
    assert ours.keys[0].dtype == ours.values[0].dtype == torch.float32  # the engine's dtype
    assert ours.logits.dtype == torch.float32
    assert engine.model.dtype == torch.float32  # the engine's own model is untouched
    assert torch.equal(engine.prefill(PROMPT, BlendConfig("full")).logits, exact.logits)
    # rounding moved the logits, both ways alike: emulated as far from native as from exact
    to_exact = kl_divergence(exact.logits, ours.logits)
    assert 0 < to_exact < 0.05
    assert kl_divergence(theirs.logits, ours.logits) < 4 * kl_divergence(
        exact.logits, theirs.logits
    )
    # the engine decodes the rounded prefill in its own dtype
    answer = engine.generate(ours, max_new_tokens=4)
    assert answer.text == engine.generate(ours, max_new_tokens=4).text


def test_the_rounded_references_are_strategies() -> None:
    floor = strategy(FLOOR)
    assert floor.rounding == "prefill" and floor.config == BlendConfig("full")
    assert strategy("full@bf16").rounding == "answer"
    assert strategy("default").rounding is None
    blend = strategy("default+lead_tokens=4@bf16")
    assert blend.rounding == "answer" and blend.config == BlendConfig(lead_tokens=4)
    with pytest.raises(ValueError, match="plain strategy"):
        strategy("default@compiled@bf16")
    assert [s.name for s in parse_strategies("default,full@bf16-prefill")] == [
        "full",
        "default",
        FLOOR,
    ]


def test_answers_agree_over_their_leading_words() -> None:
    assert same_words("The Eiffel Tower, Paris", "eiffel tower in paris", 2)
    assert not same_words("The Eiffel Tower, Paris", "eiffel tower in paris", 3)
    assert not same_words("The Eiffel Tower, Paris", "eiffel tower in paris")
    assert same_words("Paris.", "paris")


def _rows(kls: list[float], tops: list[bool], answers: list[str]) -> list[dict]:
    return [
        {"qid": f"q{i}", "kl": kl, "top1_agrees": top, "answer": answer}
        for i, (kl, top, answer) in enumerate(zip(kls, tops, answers, strict=True))
    ]


def test_figures_as_multiples_of_the_floor() -> None:
    full = {f"q{i}": answer for i, answer in enumerate(["a b c d e", "x", "y z", "w"])}
    floor = _rows([0.01] * 4, [True, True, True, False], ["a b c d e", "x", "y q", "v"])
    blend = _rows([0.03] * 4, [True, False, True, False], ["a b c d f", "t", "y q", "v"])
    agreement = closeness(blend, full)
    assert agreement["agreement_first_token"] == 0.5
    assert agreement["agreement_words_1"] == 0.5  # "a" and "y" lead as full's do
    assert agreement["agreement_words_5"] == 0.0 and agreement["agreement_answer"] == 0.0
    ratios = floor_ratios(blend, floor, full)
    assert ratios["floor_n"] == 4
    assert ratios["kl_ratio"] == pytest.approx(3.0)
    assert ratios["kl_ratio_ci"] == pytest.approx([3.0, 3.0])
    assert ratios["disagreement_ratio_first_token"] == pytest.approx(2.0)  # 2/4 against 1/4
    assert ratios["disagreement_ratio_answer"] == pytest.approx(2.0)  # 4/4 against 2/4
    assert math.isinf(
        floor_ratios(blend, _rows([0.0] * 4, [True] * 4, list(full.values())), full)["kl_ratio"]
    )
    table = closeness_table(
        [
            {
                "strategy": "default",
                "n": 4,
                "k": 10,
                "compute_fraction": 0.4,
                "kl_mean": 0.03,
                "kl_ci": [0.03, 0.03],
                **agreement,
                **ratios,
            }
        ]
    )
    assert "| 10 | default | 4 | 50.0% [" in table and "| 3.0x [3.0, 3.0] |" in table


def test_floor_ratios_come_in_the_agreement_measures_order() -> None:
    # the same keys in the same order in every process (a result's JSON is compared as text)
    full = {f"q{i}": answer for i, answer in enumerate(["a b c d e", "x", "y z", "w"])}
    floor = _rows([0.01] * 4, [True, True, True, False], ["a b c d e", "x", "y q", "v"])
    blend = _rows([0.03] * 4, [True, False, True, False], ["a b c d f", "t", "y q", "v"])
    measures = [
        key.removeprefix("agreement_")
        for key in closeness(blend, full)
        if key.startswith("agreement_") and not key.endswith("_ci")
    ]
    assert measures == ["first_token", "words_1", "words_3", "words_5", "answer"]
    ratios = [
        key.removeprefix("disagreement_ratio_")
        for key in floor_ratios(blend, floor, full)
        if key.startswith("disagreement_ratio_") and not key.endswith("_ci")
    ]
    assert ratios == measures


def test_labels_cached_with_their_passages_keep_the_prompt_text() -> None:
    tokenizer = byte_tokenizer()
    passages = [Passage("Paris", "The capital of France."), Passage("Rome", "Italy's capital.")]
    computed = nq_segments(tokenizer, "capital?", passages)
    cached = nq_segments(tokenizer, "capital?", passages, labels="cached")
    assert "".join(s.text for s in computed) == "".join(s.text for s in cached)
    assert [s.text for s in cached if s.cache and s.role != "prefix"] == [
        "Title: Paris) The capital of France.",
        "Title: Rome) Italy's capital.",
    ]
    assert [s.text for s in cached if not s.cache][:2] == ["Document [1](", "\nDocument [2]("]
    with pytest.raises(ValueError, match="labels"):
        nq_segments(tokenizer, "q", passages, labels="inline")


@pytest.fixture(scope="module")
def nq_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("nq") / "floor_nq.jsonl.gz"
    records = [
        ("Everest", "Mount Everest is the highest mountain.", "highest mountain", ["Everest"]),
        ("Pacific", "The Pacific is the largest ocean.", "largest ocean", ["Pacific"]),
        ("Fleming", "Fleming found penicillin in 1928.", "who found penicillin", ["Fleming"]),
        ("Nile", "The Nile is a long river in Africa.", "long river", ["Nile"]),
    ]
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for title, text, question, answers in records:
            record = {"question": question, "answers": answers, "title": title, "text": text}
            out.write(json.dumps(record) + "\n")
    return path


@requires_rag_stack
def test_a_run_reports_every_strategy_against_the_floor(nq_file: Path, tmp_path: Path) -> None:
    engine = _engine()
    result = run_decided(
        {"untold": engine},
        nq_file,
        parse_strategies("full,reuse,full@bf16-prefill,full@bf16,reuse@bf16,reuse@cached-labels"),
        ks=(3,),
        split="all",
        questions=3,
        options=RunOptions(max_new_tokens=3),
        cache_dir=tmp_path,
        meta={"default_config": "x"},
        labels="computed",
    )
    assert result["rounding"] == "emulated" and result["labels"] == "computed"
    rows = [r for r in result["rows"] if r["strategy"] in (FLOOR, "full@bf16", "reuse@bf16")]
    assert len(rows) == 9 and all(r["answer"] is not None and r["ttft_s"] is None for r in rows)
    assert all(r["kl"] > 0 for r in rows)  # rounding moved the first token's distribution
    summary = {s["strategy"]: s for s in result["summary"]}
    assert summary[FLOOR]["kl_ratio"] == pytest.approx(1.0)
    assert summary["reuse"]["floor_n"] == 3 and summary["reuse"]["kl_ratio"] > 0
    assert "agreement_words_5" in summary["reuse"]
    # reuse in bfloat16 read the documents the copy precomputed: as far from full as reuse
    hot = {r["qid"]: r for r in result["rows"] if r["strategy"] == "reuse@bf16"}
    cold = {r["qid"]: r for r in result["rows"] if r["strategy"] == "reuse"}
    assert all(hot[q]["documents_reused"] == cold[q]["documents_reused"] > 0 for q in hot)
    assert all(abs(hot[q]["kl"] - cold[q]["kl"]) < 0.5 * cold[q]["kl"] + 0.01 for q in hot)
    # the titles cached with their passages: the same prompt, every passage read, other KV
    titled = {r["qid"]: r for r in result["rows"] if r["strategy"] == "reuse@cached-labels"}
    assert all(titled[q]["prompt_tokens"] == cold[q]["prompt_tokens"] for q in titled)
    assert all(titled[q]["documents_reused"] == cold[q]["documents_reused"] for q in titled)
    assert any(titled[q]["kl"] != cold[q]["kl"] for q in titled)


@requires_rag_stack
def test_shards_split_the_questions_and_a_plain_run_merges_them(
    nq_file: Path, tmp_path: Path
) -> None:
    from kvblend.bench.quality.nq_eval import shard_path

    engine = _engine()
    output = tmp_path / "nq.json"
    common = dict(ks=(3,), split="all", questions=4, options=RunOptions(max_new_tokens=2),
                  cache_dir=tmp_path, meta={"default_config": "x"}, output=output)  # fmt: skip
    strategies = parse_strategies("full,reuse")
    for index in (0, 1):
        run_decided({"untold": engine}, nq_file, strategies, shard=(index, 2), **common)
    first, second = (json.loads(shard_path(output, (i, 2)).read_text()) for i in (0, 1))
    assert {r["qid"] for r in first["rows"]} == {"nq-0", "nq-2"}
    assert {r["qid"] for r in second["rows"]} == {"nq-1", "nq-3"}
    assert not output.exists()
    merged = run_decided({"untold": engine}, nq_file, strategies, **common)
    assert len(merged["rows"]) == 8  # nothing run again, nothing taken twice
    assert sorted(r["qid"] for r in merged["rows"]) == sorted(
        r["qid"] for r in first["rows"] + second["rows"]
    )
    assert json.loads(output.read_text())["rows"] == merged["rows"]
    # a shard of a run with more strategies runs only what the whole run lacks
    more = parse_strategies("full,reuse,epic")
    again = run_decided({"untold": engine}, nq_file, more, shard=(1, 2), **common)
    assert {(r["qid"], r["strategy"]) for r in again["rows"][len(second["rows"]) :]} == {
        ("nq-1", "epic"),
        ("nq-3", "epic"),
    }
    with pytest.raises(ValueError, match="shard"):
        run_decided({"untold": engine}, nq_file, strategies, shard=(2, 2), **common)


@requires_rag_stack
def test_a_prefill_reading_no_document_runs_once_for_every_head(
    nq_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = RoundedPrefill.rounded_prefill

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(RoundedPrefill, "rounded_prefill", counted)
    engine = _engine()
    result = run_decided({"told": engine, "untold": engine}, nq_file,
                         parse_strategies(f"full,{FLOOR},reuse"), ks=(3,), split="all",
                         questions=2, options=RunOptions(max_new_tokens=2), cache_dir=tmp_path,
                         meta={"default_config": "x"})  # fmt: skip
    assert len(calls) == 2  # one floor prefill a question, not one a head
    floor = {(r["qid"], r["head"]): r for r in result["rows"] if r["strategy"] == FLOOR}
    assert len(floor) == 4
    assert all(floor[q, "told"]["kl"] == floor[q, "untold"]["kl"] for q in ("nq-0", "nq-1"))


def test_the_closeness_figure_draws_every_strategy_and_the_floor(tmp_path: Path) -> None:
    from kvblend.bench.report import plot_closeness

    summary = [
        {
            "strategy": "full",
            "head": "told",
            "compute_fraction": 1.0,
            "kl_mean": 0.0,
            "kl_ci": [0.0, 0.0],
        },
        {
            "strategy": FLOOR,
            "head": "told",
            "compute_fraction": 1.0,
            "kl_mean": 0.003,
            "kl_ci": [0.002, 0.004],
        },
        {
            "strategy": "default",
            "head": "told",
            "compute_fraction": 0.4,
            "kl_mean": 0.03,
            "kl_ci": [0.02, 0.05],
        },
    ]
    path = plot_closeness([{"model": "m", "summary": summary}], tmp_path / "closeness.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


@requires_rag_stack
def test_a_run_under_another_default_keeps_every_row_but_the_default_s(
    nq_file: Path, tmp_path: Path
) -> None:
    engine = _engine()
    output = tmp_path / "nq.json"
    common = dict(ks=(3,), split="all", questions=2, options=RunOptions(max_new_tokens=2),
                  cache_dir=tmp_path, output=output)  # fmt: skip
    strategies = parse_strategies("full,reuse,default+min_recompute=0")
    then, now = ({"default_config": f"BlendConfig('attention', a={n})"} for n in (1, 2))
    first = run_decided({"untold": engine}, nq_file, strategies, meta=then, **common)
    again = run_decided({"untold": engine}, nq_file, strategies, meta=now, **common)
    kept = [r for r in first["rows"] if not r["strategy"].startswith("default")]
    assert again["rows"][: len(kept)] == kept  # full and reuse kept, not run again
    rerun = again["rows"][len(kept) :]
    assert [r["strategy"] for r in rerun] == ["default+min_recompute=0"] * 2


def test_cached_labels_is_a_layout_of_any_strategy() -> None:
    from kvblend.bench.strategies import cache_labels

    tokenizer = byte_tokenizer()
    passages = [Passage("Paris", "The capital of France."), Passage("Rome", "Italy's capital.")]
    computed = nq_segments(tokenizer, "capital?", passages)
    assert cache_labels(computed) == nq_segments(tokenizer, "capital?", passages, labels="cached")
    blend = strategy("default+lead_tokens=4@cached-labels")
    assert blend.config == BlendConfig(lead_tokens=4)
    assert blend.segments(computed) == cache_labels(computed)
    hot = strategy("default@cached-labels@bf16")
    assert hot.rounding == "answer" and hot.segments(computed) == cache_labels(computed)
    assert strategy("default").segments(computed) == computed
