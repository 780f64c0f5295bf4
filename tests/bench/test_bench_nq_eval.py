"""`kvblend bench nq` at a size that decides: splits, gold places, kept baselines, resuming,
summaries by place, and the guard's calibration sweep."""

from __future__ import annotations

import gzip
import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from conftest_langchain import requires_rag_stack
from kvblend import BlendEngine
from kvblend.bench.quality.baselines import Baseline, BaselineCache
from kvblend.bench.quality.guard_calibration import at_limit, choose_limit, separation, sweep
from kvblend.bench.quality.nq import PLACES, gold_place, place_index, with_gold
from kvblend.bench.quality.nq_eval import (
    RunOptions,
    agree,
    decided_table,
    run_decided,
    split_questions,
    stopped_note,
)
from kvblend.bench.strategies import parse_strategies
from kvblend.store import MemoryKVStore


def test_gold_places_are_deterministic_by_question_and_even() -> None:
    questions = [f"question number {i}" for i in range(900)]
    places = [gold_place(q) for q in questions]
    assert places == [gold_place(q) for q in questions]
    counts = Counter(places)
    assert set(counts) == set(PLACES) and min(counts.values()) > 250  # about a third each
    assert [place_index(p, 10) for p in PLACES] == [0, 4, 9]
    assert [place_index(p, 20) for p in PLACES] == [0, 9, 19]
    rng = random.Random(0)
    assert with_gold([4, 7, 1, 2], 7, 3, rng, place=2) == [4, 1, 7]  # retrieved, moved last
    assert with_gold([4, 7, 1, 2], 9, 3, rng, place=0) == [9, 4, 7]  # missed, put first


def test_splits_keep_evaluation_and_calibration_apart() -> None:
    assert split_questions("eval", 0, 500, 2000) == (0, 500)
    assert split_questions("calibration", 20, 100, 2000) == (1020, 1120)
    with pytest.raises(ValueError, match="eval split"):
        split_questions("eval", 400, 200, 2000)
    with pytest.raises(ValueError, match="calibration split"):
        split_questions("calibration", 900, 200, 2000)
    assert agree("The Eiffel tower.", "the eiffel Tower") and not agree("Paris", "Lyon")
    assert agree(None, "x") is None


def test_baselines_round_trip_by_model_dtype_and_tokens(tmp_path: Path) -> None:
    cache = BaselineCache(tmp_path)
    key = cache.key("model-a", "torch.float32", [1, 2, 3], {"max_new_tokens": 4})
    assert key != cache.key("model-a", "torch.bfloat16", [1, 2, 3], {"max_new_tokens": 4})
    assert key != cache.key("model-a", "torch.float32", [1, 2, 4], {"max_new_tokens": 4})
    assert cache.get(key) is None and cache.misses == 1
    logits = torch.randn(17)
    cache.put(key, Baseline("Paris.", logits, 3, 0.5))
    got = cache.get(key)
    assert got is not None and got.answer == "Paris." and torch.equal(got.logits, logits)
    assert cache.hits == 1 and not list(tmp_path.rglob("*.tmp"))


RECORDS = [
    (f"Place {i}", f"Town {i} lies on river {i} and has {i} bridges over it.",
     f"how many bridges has town {i}", [str(i)])
    for i in range(1, 7)
]  # fmt: skip


@pytest.fixture(scope="module")
def nq_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("nq") / "tiny_nq.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as out:
        for title, text, question, answers in RECORDS:
            out.write(json.dumps({"question": question, "answers": answers, "title": title,
                                  "text": text}) + "\n")  # fmt: skip
    return path


@requires_rag_stack
def test_a_run_keeps_baselines_resumes_and_reports_by_place(nq_file: Path, tmp_path: Path) -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="t")
    engines = {"untold": engine}
    cache = BaselineCache(tmp_path / "baselines")
    output = tmp_path / "nq.json"
    options = RunOptions(max_new_tokens=3, time_every=2)
    meta = {"default_config": "x"}
    first = run_decided(engines, nq_file, parse_strategies("full,reuse"), ks=(3,), split="all",
                        questions=4, options=options, cache=cache, cache_dir=tmp_path,
                        output=output, meta=meta)  # fmt: skip
    assert cache.misses == 4 and cache.hits == 0
    rows = first["rows"]
    assert [(r["qid"], r["strategy"]) for r in rows][:2] == [("nq-0", "full"), ("nq-0", "reuse")]
    assert all(r["place"] in PLACES for r in rows)
    assert {s["place"] for s in first["by_place"]} <= set(PLACES)
    assert all(r["full_ttft_s"] is not None for r in rows)  # computed now: all timed
    # resumed with one more strategy: only its rows run; full prefill is read from the cache
    again = run_decided(engines, nq_file, parse_strategies("full,reuse,epic"), ks=(3,),
                        split="all", questions=4, options=options, cache=cache,
                        cache_dir=tmp_path, output=output, meta=meta)  # fmt: skip
    assert len(again["rows"]) == len(rows) + 4 and again["rows"][: len(rows)] == rows
    assert cache.hits == 4 and cache.misses == 4
    epic = [r for r in again["rows"] if r["strategy"] == "epic"]
    assert [r["full_ttft_s"] is not None for r in epic] == [True, False, True, False]  # retimed
    summary = {s["strategy"]: s for s in again["summary"]}
    assert summary["full"]["agreement"] == 1.0 and summary["epic"]["ttft_n"] == 2
    assert "| 3 | untold | epic | 4 |" in decided_table(again["summary"], ("k", "head"))
    with pytest.raises(ValueError, match="max_new_tokens"):  # another setting: refused
        run_decided(engines, nq_file, parse_strategies("full,reuse"), ks=(3,), split="all",
                    questions=4, options=RunOptions(max_new_tokens=5), cache=cache,
                    cache_dir=tmp_path, output=output, meta=meta)  # fmt: skip


@requires_rag_stack
def test_a_stopped_run_says_how_far_it_got_and_resumes(nq_file: Path, tmp_path: Path) -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="t")
    output = tmp_path / "nq.json"

    def stop_after_two() -> bool:  # asked between questions: two are in the checkpoint
        rows = json.loads(output.read_text())["rows"] if output.exists() else []
        return len({row["qid"] for row in rows}) >= 2

    settings = {"split": "all", "questions": 4, "options": RunOptions(max_new_tokens=2),
                "cache_dir": tmp_path, "output": output,
                "meta": {"default_config": "x"}}  # fmt: skip
    stopped = run_decided({"untold": engine}, nq_file, parse_strategies("full,reuse"), ks=(3,),
                          stop=stop_after_two, **settings)  # fmt: skip
    assert stopped["stopped"] == {"questions_done": 2, "questions": 4}
    assert {r["qid"] for r in stopped["rows"]} == {"nq-0", "nq-1"}
    assert json.loads(output.read_text())["stopped"] == stopped["stopped"]  # checkpointed
    assert (
        stopped_note(stopped) == "stopped after 2 of 4 questions (the same command resumes the run)"
    )
    done = run_decided({"untold": engine}, nq_file, parse_strategies("full,reuse"), ks=(3,),
                       stop=lambda: False, **settings)  # fmt: skip
    assert "stopped" not in done and stopped_note(done) == ""
    assert len(done["rows"]) == 8 and done["rows"][:4] == stopped["rows"]


def _row(qid: int, agrees: bool, shift: float) -> dict:
    return {"qid": qid, "agrees": agrees, "correct": agrees, "full_correct": True,
            "compute_fraction": 0.3, "prefix_tokens": 10, "prompt_tokens": 110,
            "guard": {"signals": {"shift": shift, "margin": 1 - shift}}}  # fmt: skip


def test_the_calibration_sweep_counts_what_a_limit_would_escalate() -> None:
    rows = [_row(0, False, 0.9), _row(1, True, 0.5), _row(2, False, 0.4), _row(3, True, 0.1)]
    half = at_limit(rows, "shift", 0.45)
    assert half["escalated"] == 0.5 and half["precision"] == 0.5 and half["recall"] == 0.5
    assert half["kept_agreement"] == 0.5 and half["agreement"] == 0.75
    assert half["compute"] == pytest.approx(0.3 + 0.5 * 100 / 110)
    # low margin is risk: below 0.55 (margins 0.1, 0.5, 0.6, 0.9) is above 0.45 of shift
    assert at_limit(rows, "margin", 0.55) == {**half, "signal": "margin", "limit": 0.55}
    table = sweep(rows, "shift")
    assert table[0]["escalated"] == 0 and math.isnan(table[0]["precision"])
    best = choose_limit(table, budget=0.6)
    assert best is not None and best["compute"] <= 0.6
    assert choose_limit(table, budget=0.1) is None
    # the differing answers' risks (0.9, 0.4) against the agreeing ones' (0.5, 0.1): 3 of 4 above
    found = separation(rows, "shift", resamples=50)
    assert found["auc"] == 0.75 and found["differ"] == 2 and found["n"] == 4
    assert 0 <= found["auc_ci"][0] <= found["auc_ci"][1] <= 1
    assert separation(rows, "margin", resamples=0)["auc"] == 0.75  # low margin is risk
    first = [{**row, "top1_agrees": True} for row in rows]
    assert math.isnan(separation(first, "shift", target="top1_agrees", resamples=0)["auc"])


@requires_rag_stack
def test_a_guarded_strategy_gets_its_unguarded_rows(nq_file: Path, tmp_path: Path) -> None:
    from kvblend.bench.strategies import Strategy
    from kvblend.blend.config import BlendConfig

    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="t")
    blend = BlendConfig(min_recompute=0, short_document=0, full_above=1.0, lead_tokens=1)
    strategies = [Strategy("full", BlendConfig("full")), Strategy("g", blend.replace(guard=0.0)),
                  Strategy("w", blend.replace(guard=math.inf))]  # fmt: skip
    result = run_decided({"untold": engine}, nq_file, strategies, ks=(3,), split="all",
                         questions=2, options=RunOptions(max_new_tokens=2, time_every=1),
                         cache_dir=tmp_path, meta={"default_config": "x"})  # fmt: skip
    rows = {(r["qid"], r["strategy"]): r for r in result["rows"]}
    for qid in ("nq-0", "nq-1"):
        escalated, free = rows[qid, "g@unguarded"], rows[qid, "g"]
        assert free["escalated"] and free["kl"] == pytest.approx(0, abs=1e-6)
        assert escalated["guard_would_escalate"] and not escalated["escalated"]
        assert escalated["kl"] == pytest.approx(rows[qid, "w"]["kl"])  # the blend itself
        assert rows[qid, "w@unguarded"]["answer"] == rows[qid, "w"]["answer"]
    rates = {s["strategy"]: s["escalation_rate"] for s in result["summary"]}
    assert rates["g"] == 1.0 and rates["g@unguarded"] == rates["w"] == 0.0


@requires_rag_stack
def test_rows_record_the_margins_of_the_answers_first_tokens(nq_file: Path, tmp_path: Path) -> None:
    """Every decoded row holds its answer's first margins; full prefill's come with its cached
    baseline, which gains them by running once more when it was kept without them."""
    from kvblend.bench.strategies import Strategy
    from kvblend.blend.config import BlendConfig

    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="t")
    blend = BlendConfig(min_recompute=0, short_document=0, full_above=1.0, lead_tokens=1)
    strategies = [Strategy("full", BlendConfig("full")),
                  Strategy("w", blend.replace(guard=math.inf, guard_signal="margin"))]  # fmt: skip
    cache = BaselineCache(tmp_path / "baselines")

    def run(margins: int, name: str) -> list[dict]:
        result = run_decided({"untold": engine}, nq_file, strategies, ks=(3,), split="all",
                             questions=2, cache=cache, cache_dir=tmp_path, meta={},
                             options=RunOptions(max_new_tokens=4, time_every=0, margins=margins),
                             output=tmp_path / name)  # fmt: skip
        return result["rows"]

    bare = run(0, "bare.json")
    assert len(bare) == 6 and all(r["margins"] is None for r in bare)  # none asked for
    rows = run(3, "margins.json")
    assert cache.misses == 2 and cache.hits == 2
    for row in rows:
        assert 1 <= len(row["margins"]) <= 3 and all(0 <= m <= 1 for m in row["margins"])
        if row["strategy"] == "full":  # ran again for its margins: timed, the same answer
            assert row["baseline_confirmed"] is True and row["full_ttft_s"] is not None
        else:  # the first token's margin is the guard's, made from the same logits
            assert row["guard"]["signal"] == "margin" and not row["escalated"]
            assert row["margins"][0] == pytest.approx(row["guard"]["signals"]["margin"], rel=1e-4)
    again = run(3, "again.json")  # the entries kept the margins: nothing runs full prefill
    assert cache.hits == 4 and all(r["full_ttft_s"] is None for r in again)
    assert [r["margins"] for r in again if r["strategy"] == "full"] == [
        r["margins"] for r in rows if r["strategy"] == "full"]  # fmt: skip
