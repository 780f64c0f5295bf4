"""``kvblend bench vllm --nq``'s pieces: the prompt file, a server's answer, the paired summary."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from conftest import byte_tokenizer, tiny_model
from conftest_langchain import requires_rag_stack
from kvblend import BlendEngine
from kvblend.bench.quality.compare import PromptItem
from kvblend.bench.quality.nq import (
    Passage,
    Retriever,
    best_subspan_em,
    load_nq,
    nq_items,
    nq_segments,
    read_prompts,
    run_nq,
    write_prompts,
)
from kvblend.bench.vllm import server as vllm_server
from kvblend.bench.vllm.nq import PAIRS, ask, prompt_text, summarize_nq, vllm_nq_table
from kvblend.store import MemoryKVStore


@pytest.fixture(scope="module")
def tiny_engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="tiny")


def _item(engine: BlendEngine, qid: str, answers: list[str]) -> PromptItem:
    passages = [Passage("Paris", "Paris is the capital of France."), Passage("Ö", "Öl, ümlaut.")]
    return PromptItem(
        qid=qid,
        segments=nq_segments(engine.tokenizer, "capital of france?", passages),
        answers=answers,
        score=lambda answer: best_subspan_em(answer, answers),
        meta={"k": 2, "gold_position": 0, "gold_retrieved": True},
    )


def test_prompt_file_round_trip(tiny_engine: BlendEngine, tmp_path: Path) -> None:
    items = [_item(tiny_engine, "nq-0", ["Paris"]), _item(tiny_engine, "nq-1", ["Lyon", "x"])]
    path = tmp_path / "prompts.jsonl"
    assert write_prompts(items, path) == 2
    back = read_prompts(path)
    assert [b.qid for b in back] == ["nq-0", "nq-1"]
    for item, again in zip(items, back, strict=True):
        assert again.segments == item.segments  # text, role and cache of every segment
        assert again.answers == item.answers and again.meta == item.meta
        assert prompt_text(again) == "".join(s.text for s in item.segments)
        assert again.documents == item.documents
    assert back[0].score("It is Paris.") and not back[1].score("It is Paris.")
    assert back[1].score("the city of lyon")


@requires_rag_stack
def test_bench_nq_writes_its_prompts_and_runs_nothing(
    tiny_engine: BlendEngine, tmp_path: Path
) -> None:
    data = tmp_path / "nq.jsonl.gz"
    records = [
        (city, f"{city} is the capital of {land}.", f"capital of {land.lower()}", [city])
        for city, land in (("Paris", "France"), ("Rome", "Italy"), ("Oslo", "Norway"))
    ]
    with gzip.open(data, "wt", encoding="utf-8") as out:
        for title, text, question, answers in records:
            out.write(json.dumps({"question": question, "answers": answers, "title": title,
                                  "text": text}) + "\n")  # fmt: skip
    path = tmp_path / "prompts.jsonl"
    result = run_nq({"untold": tiny_engine}, data, [], ks=(1, 2), questions=3, cache_dir=tmp_path,
                    prompts_file=path)  # fmt: skip
    assert result["prompts"] == 6 and result["rows"] == [] and set(result["recall"]) == {"1", "2"}
    back = read_prompts(path)
    corpus, questions = load_nq(data)
    retriever = Retriever(corpus, data_path=data, cache_dir=tmp_path)
    expected = nq_items(tiny_engine, corpus, questions, retriever, k=2)
    assert [b.meta["k"] for b in back] == [1, 1, 1, 2, 2, 2]
    assert [b.segments for b in back[3:]] == [e.segments for e in expected]


def test_ask_sends_the_prompt_string_and_reads_the_usage(
    tiny_engine: BlendEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    item = _item(tiny_engine, "nq-0", ["Paris"])
    sent: dict[str, Any] = {}

    def complete(url: str, prompt: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
        sent.update(url=url, prompt=prompt, max_tokens=max_tokens, **extra)
        return {
            "choices": [{"text": "  Paris, France. "}],
            "usage": {"prompt_tokens": 321, "prompt_tokens_details": {"cached_tokens": 250}},
            "kv_transfer_params": {"kvblend": {"recomputed_tokens": 40, "fallback": None}},
        }

    monkeypatch.setattr(vllm_server, "complete", complete)
    row = ask("http://server", item, 32)
    assert sent == {"url": "http://server", "prompt": prompt_text(item), "max_tokens": 32,
                    "stop": ["\n"], "ignore_eos": False}  # fmt: skip
    assert row == {"answer": "Paris, France.", "correct": True, "prompt_tokens": 321,
                   "cached_tokens": 250,
                   "kvblend": {"recomputed_tokens": 40, "fallback": None}}  # fmt: skip


def _record(qid: int, right: dict[str, bool], answers: dict[str, str]) -> dict[str, Any]:
    served = {"prompt_tokens": 100, "cached_tokens": 10, "kvblend": None}
    engine = {"prompt_tokens": 100, "reused_tokens": 10, "recomputed_tokens": 0, "fallback": None,
              "fallback_cause": None, "kl": 0.0}  # fmt: skip
    record: dict[str, Any] = {"qid": f"nq-{qid}"}
    for name in ("vllm", "vllm_kvblend", "engine_full", "engine_default"):
        base = served if name.startswith("vllm") else engine
        record[name] = {**base, "answer": answers[name], "correct": right[name]}
    record["vllm_kvblend"].update(cached_tokens=80, kvblend={"recomputed_tokens": 20,
                                                             "fallback": None})  # fmt: skip
    record["engine_default"].update(reused_tokens=70, recomputed_tokens=30)
    return record


def test_summary_pairs_each_system_with_its_baseline_question_by_question() -> None:
    names = ("vllm", "vllm_kvblend", "engine_full", "engine_default")
    same = dict.fromkeys(names, "a")
    right, wrong = dict.fromkeys(names, True), dict.fromkeys(names, False)
    records = [
        _record(0, right, same),
        _record(1, {**right, "vllm_kvblend": False}, {**same, "vllm_kvblend": "b"}),
        _record(2, wrong, same),
        _record(3, {**wrong, "engine_default": True}, {**same, "engine_default": "c"}),
    ]
    records[3]["engine_default"].update(fallback="full_above: blend would cost 0.9 of full",
                                        fallback_cause="full_above")  # fmt: skip
    records[2]["vllm_kvblend"]["prompt_tokens"] = 101
    records[1]["vllm_kvblend"]["kvblend"] = None  # a stop string ended it: vLLM drops the report
    summary = summarize_nq(records, seed=3)
    systems = summary["systems"]
    assert systems["vllm"]["accuracy"] == 0.5 and systems["vllm_kvblend"]["accuracy"] == 0.25
    assert systems["engine_default"]["accuracy"] == 0.75
    assert systems["vllm_kvblend"]["cached_tokens"] == 80
    assert systems["vllm_kvblend"]["recomputed_tokens"] == 20
    assert (
        systems["engine_default"]["cached_tokens"] == 70
        and systems["vllm"]["recomputed_tokens"] is None
    )
    pairs = {(p["system"], p["baseline"]): p for p in summary["pairs"]}
    assert list(pairs) == list(PAIRS)
    blended = pairs[("vllm_kvblend", "engine_default")]
    assert blended["difference"] == pytest.approx(-0.5) and blended["agreement"] == 0.5
    low, high = blended["difference_ci"]
    assert low <= -0.5 <= high
    assert pairs[("vllm", "engine_full")]["agreement"] == 1.0
    assert pairs[("vllm", "engine_full")]["difference"] == 0.0
    checks = summary["checks"]
    assert checks["same_prompt_tokens"] == 0.75
    assert checks["connector_outcomes"] == {"blended": 3, "no report": 1}
    assert checks["engine_outcomes"] == {"blended": 3, "full_above": 1}
    table = vllm_nq_table({"summary": summary, "model": "/m/SmolLM2", "questions": 4,
                           "prompts": "p.jsonl", "max_new_tokens": 32})  # fmt: skip
    assert "| vLLM + kvblend vs engine, default | 4 | 25.0% | 75.0% | -50.0 [" in table
    assert "| vLLM + kvblend | 25.0% | 100 | 80 | 20 |" in table
