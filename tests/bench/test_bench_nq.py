"""The NQ retrieval benchmark, the paired statistics and the shapes report's prompt builders."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import byte_tokenizer, tiny_model
from conftest_langchain import requires_model, requires_rag_stack
from kvblend import BlendConfig, BlendEngine
from kvblend.bench import main as bench_main
from kvblend.bench.quality.compare import PromptItem, evaluate_item, summarize_rows, summary_table
from kvblend.bench.quality.nq import (
    Passage,
    Retriever,
    best_subspan_em,
    load_nq,
    normalize_answer,
    nq_items,
    nq_segments,
    with_gold,
)
from kvblend.bench.quality.qa import generate_qa
from kvblend.bench.quality.qa_bench import run_quality
from kvblend.bench.quality.shapes import parse_shapes, qa_items
from kvblend.bench.quality.stats import paired_stats, paired_table, strategy_stats
from kvblend.bench.strategies import parse_strategies
from kvblend.store import MemoryKVStore

RECORDS = [
    ("Mount Everest", "Mount Everest is Earth's highest mountain above sea level, located in "
     "the Himalayas on the border between Nepal and China.", "what is the highest mountain on "
     "earth", ["Mount Everest"]),
    ("Pacific Ocean", "The Pacific Ocean is the largest and deepest of Earth's five oceanic "
     "divisions.", "which is the largest ocean", ["Pacific", "Pacific Ocean"]),
    ("Penicillin", "Penicillin was discovered in 1928 by Scottish scientist Alexander "
     "Fleming.", "who discovered penicillin", ["Alexander Fleming"]),
    ("Photosynthesis", "Photosynthesis is the process used by plants to convert light energy "
     "into chemical energy.", "how do plants turn light into energy", ["photosynthesis"]),
    ("Tour de France", "The Tour de France is an annual men's multiple-stage bicycle race "
     "held primarily in France.", "what is the famous bicycle race in france",
     ["Tour de France"]),
    ("Great Wall of China", "The Great Wall of China is a series of fortifications built "
     "across the historical northern borders of ancient Chinese states.",
     "what wall was built along china's northern border", ["Great Wall"]),
]  # fmt: skip


@pytest.fixture(scope="module")
def nq_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("nq") / "tiny_nq.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for title, text, question, answers in RECORDS:
            record = {"question": question, "answers": answers, "title": title, "text": text}
            out.write(json.dumps(record) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="tiny")


# ----------------------------------------------------------------------------- metric
def test_normalization_follows_the_squad_definition():
    assert normalize_answer("The Eiffel Tower!") == "eiffel tower"
    assert normalize_answer("U.S.A.") == "usa"  # punctuation is deleted, not made a space
    assert normalize_answer("an apple a day") == "apple day"
    assert normalize_answer("  Theater   of\tthe  Absurd ") == "theater of absurd"
    assert normalize_answer("Wilhelm Conrad Röntgen") == "wilhelm conrad röntgen"


def test_best_subspan_exact_match():
    answers = ["Wilhelm Conrad Röntgen"]
    assert best_subspan_em("It was awarded to Wilhelm Conrad Röntgen, of Germany.", answers)
    assert not best_subspan_em("It was awarded to Wilhelm Röntgen.", answers)
    assert best_subspan_em("May 18, 2018", ["May 18 2018"])
    assert best_subspan_em("In the 1990s", ["1990"])  # a sub-span, not a whole-word match
    assert best_subspan_em("No idea", ["Paris", "no"])  # any accepted answer counts
    assert not best_subspan_em("anything at all", ["The"])  # normalizes to nothing: never matches


# ----------------------------------------------------------------------------- retrieval
def test_gold_insertion_is_seeded_and_replaces_the_last():
    assert with_gold([4, 7, 1], 7, 3, random.Random(0)) == [4, 7, 1]
    placed = [with_gold([4, 7, 1, 2], 9, 3, random.Random(seed)) for seed in range(20)]
    assert all(len(p) == 3 and 9 in p and sorted(set(p) - {9}) == [4, 7] for p in placed)
    assert placed == [with_gold([4, 7, 1, 2], 9, 3, random.Random(s)) for s in range(20)]
    assert len({p.index(9) for p in placed}) == 3  # every position is drawn
    moved = [with_gold([4, 7, 1, 2], 7, 3, random.Random(s), move=True) for s in range(20)]
    assert all([i for i in p if i != 7] == [4, 1] for p in moved)  # the others keep their order
    assert len({p.index(7) for p in moved}) == 3


def test_load_nq_dedupes_the_corpus(tmp_path: Path):
    path = tmp_path / "dup.jsonl"
    lines = [{"question": f"q{i}", "answers": ["a"], "title": "T", "text": "same"} for i in (0, 1)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    corpus, questions = load_nq(path)
    assert corpus == [Passage("T", "same")] and [q.gold for q in questions] == [0, 0]


@requires_rag_stack
def test_retriever_finds_the_gold_and_caches_embeddings(nq_file: Path, tmp_path: Path):
    corpus, questions = load_nq(nq_file)
    retriever = Retriever(corpus, data_path=nq_file, cache_dir=tmp_path)
    assert not retriever.cached and retriever.cache_path.exists()
    top = retriever.search([q.question for q in questions], 2)
    assert [row[0] for row in top] == [q.gold for q in questions]
    again = Retriever(corpus, data_path=nq_file, cache_dir=tmp_path)
    assert again.cached
    np.testing.assert_array_equal(again.index.reconstruct_n(0, len(corpus)),
                                  retriever.index.reconstruct_n(0, len(corpus)))  # fmt: skip


@requires_rag_stack
def test_prompts_label_outside_the_cache_and_reuse_every_passage(
    nq_file: Path, tmp_path: Path, tiny_engine: BlendEngine
):
    corpus, questions = load_nq(nq_file)
    retriever = Retriever(corpus, data_path=nq_file, cache_dir=tmp_path)
    # a question whose gold passage the retriever misses at k=2: it is put in anyway
    odd = questions[0].__class__(99, "who discovered penicillin", ["x"], questions[3].gold)
    items = nq_items(tiny_engine, corpus, [*questions, odd], retriever, k=2, seed=5)
    assert all(len(item.documents) == 2 for item in items)
    assert not items[-1].meta["gold_retrieved"]
    assert " " + corpus[odd.gold].text in items[-1].documents
    segments = items[0].segments
    labels = [s.text for s in segments if not s.cache and "Document [" in s.text]
    assert labels[0].startswith("Document [1](Title: ") and labels[1].startswith("\nDocument [2]")
    assert all("Document [" not in d and "Title:" not in d for d in items[0].documents)
    assert segments[0].role == "prefix" and segments[-1].text.startswith("\n\nQuestion: ")
    tiny_engine.precompute(items[0].documents, progress=False)
    stats = tiny_engine.prefill(segments, BlendConfig("reuse")).stats
    assert stats.documents_found == stats.documents_reused == 2


def test_long_documents_join_passages_under_one_label(tiny_engine: BlendEngine):
    passages = [Passage(f"T{i}", f"text number {i}.") for i in range(12)]
    segments = nq_segments(tiny_engine.tokenizer, "q?", passages, group=4)
    cached = [s.text for s in segments if s.cache and s.role == "document"]
    assert len(cached) == 3
    assert cached[1] == " text number 4. (Title: T5) text number 5. (Title: T6) text number 6. " \
        "(Title: T7) text number 7."  # fmt: skip
    assert sum("Document [" in s.text for s in segments) == 3


def test_records_shape_has_four_to_six_one_line_documents(tiny_engine: BlendEngine):
    items = qa_items(tiny_engine, "records", 12, seed=1)
    assert all(4 <= len(item.documents) <= 6 for item in items)
    assert all(len(d) < 80 for item in items for d in item.documents)
    assert parse_shapes("all")[0] == "nq-5" and parse_shapes("qa,long") == ["qa", "long"]
    with pytest.raises(ValueError, match="unknown shape"):
        parse_shapes("nq-7")


def test_evaluate_item_rows_per_head(tiny_engine: BlendEngine):
    item = qa_items(tiny_engine, "qa", 1, seed=0)[0]
    told = BlendEngine(tiny_engine.model, tiny_engine.tokenizer, store=tiny_engine.store,
                       doc_prefix=item.head, name="tiny")  # fmt: skip
    engines = {"told": told, "untold": tiny_engine}
    rows = evaluate_item(engines, item, parse_strategies("reuse"), max_new_tokens=2)
    assert [(r["head"], r["strategy"]) for r in rows] == [
        ("told", "full"),
        ("told", "reuse"),
        ("untold", "full"),
        ("untold", "reuse"),
    ]
    assert rows[0]["answer"] == rows[2]["answer"] and rows[1]["documents_reused"] > 0
    assert all(r["agrees"] == (r["answer"] == rows[0]["answer"]) for r in rows)
    summary = summarize_rows(rows)
    by_key = {(s["head"], s["strategy"]): s for s in summary}
    assert by_key[("told", "full")]["agreement"] == 1.0
    assert by_key[("told", "reuse")]["agreement"] == float(rows[1]["agrees"])
    table = summary_table(summary)
    assert "agreement with full" in table.splitlines()[0]
    assert f"| {by_key[('untold', 'reuse')]['agreement']:.0%} |" in table.splitlines()[-1]
    assert {(s["head"], s["strategy"]) for s in summary} == {(r["head"], r["strategy"])
                                                             for r in rows}  # fmt: skip
    with pytest.raises(ValueError, match="full"):
        evaluate_item(engines, PromptItem("x", item.segments, [], bool),
                      parse_strategies("reuse")[1:])  # fmt: skip


# ----------------------------------------------------------------------------- statistics
def test_paired_bootstrap_contains_the_difference_and_is_seeded():
    rng = np.random.default_rng(1)
    full = rng.random(60) < 0.6
    ours = full & (rng.random(60) < 0.8)
    stats = paired_stats(ours, full, kl=rng.random(60), agrees=ours == full, seed=3)
    low, high = stats["difference_ci"]
    assert low <= stats["difference"] <= high and high <= 0.0  # ours never beats full here
    assert stats["difference"] == pytest.approx(ours.mean() - full.mean())
    assert stats["share_of_full"] == pytest.approx(ours.mean() / full.mean())
    assert stats["kl_ci"][0] <= stats["kl_mean"] <= stats["kl_ci"][1]
    assert paired_stats(ours, full, seed=3)["difference_ci"] == [low, high]
    assert paired_stats(ours, full, seed=4)["difference_ci"] != [low, high]


def test_strategy_stats_pairs_by_question():
    rows = [{"qid": q, "strategy": s, "correct": c, "kl": 0.0, "agrees": True}
            for q, s, c in [(1, "full", True), (2, "full", False), (2, "x", True),
                            (1, "x", True), (3, "x", False)]]  # fmt: skip
    stats = strategy_stats(rows)
    assert stats["x"]["n"] == 2 and stats["x"]["difference"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="full"):
        strategy_stats([r for r in rows if r["strategy"] == "x"])


def test_quality_rows_get_the_paired_table(tiny_engine: BlendEngine):
    strategies = parse_strategies("reuse")
    result = run_quality(tiny_engine, generate_qa(4), strategies, max_new_tokens=2, log=print)
    table = paired_table(strategy_stats(result["rows"]))
    assert "| full | 4 | " in table and "| reuse | 4 | " in table
    assert table.splitlines()[0].endswith("| agreement with full |")
    assert table.splitlines()[2].endswith("| 100% |")  # full prefill agrees with itself


@requires_model
@requires_rag_stack
@pytest.mark.slow
def test_bench_nq_end_to_end_writes_json(nq_file: Path, tmp_path: Path):
    output = tmp_path / "nq.json"
    argv = ["nq", "--data", str(nq_file), "--questions", "2", "--k", "3", "--strategies",
            "full,reuse", "--max-new-tokens", "4", "--cache-dir", str(tmp_path),
            "--output", str(output), "--threads", "2"]  # fmt: skip
    assert bench_main(argv) == 0
    result = json.loads(output.read_text())
    assert result["benchmark"] == "nq" and result["questions"] == 2
    assert [(r["head"], r["strategy"]) for r in result["rows"]] == [
        ("untold", "full"),
        ("untold", "reuse"),
    ] * 2
    assert all(r["documents_reused"] == 3 for r in result["rows"] if r["strategy"] != "full")
    assert {s["strategy"] for s in result["summary"]} == {"full", "reuse"}
    assert "| 3 | untold | reuse | 2 |" in output.with_suffix(".md").read_text()


@requires_rag_stack
@pytest.mark.slow
def test_bench_nq_stopped_by_sigterm_writes_what_it_ran(
    nq_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import signal
    import threading

    from kvblend.bench.quality import nq_eval

    assert threading.current_thread() is threading.main_thread()  # where signals arrive
    evaluate, sent = nq_eval.evaluate_question, []

    def evaluate_then_terminate(*args: Any, **kwargs: Any) -> Any:
        rows = evaluate(*args, **kwargs)
        if not sent:  # the first question done: the run is asked to stop
            sent.append(True)
            signal.raise_signal(signal.SIGTERM)
        return rows

    monkeypatch.setattr(nq_eval, "evaluate_question", evaluate_then_terminate)
    output = tmp_path / "nq.json"
    argv = ["nq", "--data", str(nq_file), "--questions", "2", "--k", "3", "--strategies",
            "full,reuse", "--max-new-tokens", "2", "--cache-dir", str(tmp_path),
            "--output", str(output), "--threads", "1"]  # fmt: skip
    previous = signal.getsignal(signal.SIGTERM)
    assert bench_main(argv) == 0
    assert signal.getsignal(signal.SIGTERM) == previous  # the handler was the run's only
    result = json.loads(output.read_text())
    assert result["stopped"] == {"questions_done": 1, "questions": 2}
    assert result["command"] and len(result["rows"]) == 2  # the run is named
    assert "stopped after 1 of 2 questions" in output.with_suffix(".md").read_text()
    assert bench_main(argv) == 0  # the same command finishes it
    result = json.loads(output.read_text())
    assert "stopped" not in result and len(result["rows"]) == 4
    assert "stopped" not in output.with_suffix(".md").read_text()


def test_bench_plan_times_nq_passages_in_the_papers_prompt(nq_file: Path) -> None:
    """``kvblend bench plan --nq``: the data file's passages are the documents, each found."""
    from kvblend.bench.speed.planning import planning_line, run_planning, tokenizer_engine

    engine = tokenizer_engine(byte_tokenizer())
    result = run_planning(engine, prompt_tokens=300, doc_tokens=0, repeats=2, nq=nq_file)
    assert result["documents"] >= 2 and result["documents_found"] == result["documents"]
    assert result["prompt_tokens"] >= 300 and result["spliced"]
    assert "x the tokenizer" in planning_line(result)
