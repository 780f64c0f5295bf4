"""Benchmark code: the generated QA task, scoring, and both runners end to end on a tiny model."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.bench import main as bench_main
from kvblend.bench.quality.qa import QUESTION_TYPES, generate_qa, normalize, score
from kvblend.bench.quality.qa_bench import kl_divergence, run_quality, summarize
from kvblend.bench.speed.synthetic import synthetic_text
from kvblend.bench.speed.ttft import run_ttft
from kvblend.bench.speed.ttft_summary import summarize_ttft
from kvblend.bench.strategies import all_strategy_names, parse_strategies, strategy
from kvblend.store import MemoryKVStore


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="tiny")


def test_qa_is_deterministic_and_large_enough():
    first = [item.to_dict() for item in generate_qa(240, seed=3)]
    again = [item.to_dict() for item in generate_qa(240, seed=3)]
    other = [item.to_dict() for item in generate_qa(240, seed=4)]
    assert first == again
    assert first != other
    assert len(first) >= 200
    assert len({item["qid"] for item in first}) == len(first)


def test_qa_has_every_question_type_and_two_document_questions():
    items = generate_qa(240)
    counts = Counter(item.qtype for item in items)
    assert set(counts) == set(QUESTION_TYPES)
    assert min(counts.values()) >= 10
    assert any(len(item.evidence) == 2 for item in items)
    lengths = [len(d) for item in items for d in item.documents]
    assert min(lengths) < 80 and max(lengths) > 300  # one-line records and long profiles
    assert all(3 <= len(item.documents) <= 5 for item in items)


def test_qa_answers_appear_in_the_evidence_documents():
    for item in generate_qa(240):
        evidence = " ".join(item.documents[i] for i in item.evidence)
        if item.qtype == "same_city":
            assert item.answers in (["yes"], ["no"])
            cities = [d.split(" lives in ")[1].split()[0].strip(".") for d in
                      (item.documents[i] for i in item.evidence)]  # fmt: skip
            assert (cities[0] == cities[1]) == (item.answers == ["yes"])
        else:
            assert any(answer in evidence for answer in item.answers), item
        for wrong in item.wrong:
            assert wrong not in item.answers


def test_scoring_normalises_and_rejects_the_other_option():
    assert normalize("  The Oslo!  ") == "oslo"
    assert score("Alice Brown lives in Oslo.", ["Oslo"])
    assert score("OSLO", ["Oslo"])
    assert not score("Oslofjord", ["Oslo"])  # whole words only
    assert not score("Paris", ["Oslo"])
    assert score("a baker.", ["baker"])
    assert not score("Alice and Bruno", ["Alice"], wrong=["Bruno"])
    assert score("Yes, they do.", ["yes"])
    assert not score("No, not yes.", ["yes"])


def test_strategy_names_round_trip():
    names = all_strategy_names()
    assert len(names) == 16 and names[0] == "full"
    assert strategy("attention-0.2").config == BlendConfig("attention", recompute_ratio=0.2)
    assert strategy("attention-0.2").recompute_ratio == 0.2
    assert strategy("cacheblend-key-0.3").config.deviation == "key"
    assert strategy("cacheblend-key-0.3").config.recompute_ratio == 0.3
    assert strategy("cacheblend-value-0.15-L2").config.check_layer == 2
    assert strategy("default").config == BlendConfig()
    # cacheblend names are CacheBlend as published; -c<share> sets the stale-KV correction
    assert strategy("cacheblend-value-0.15").config.correction == 0.0
    assert strategy("cacheblend-value-0.15-L2-c0.5").config == BlendConfig(
        "cacheblend", recompute_ratio=0.15, check_layer=2, correction=0.5
    )
    assert strategy("attention-0.2-c0").config == BlendConfig(
        "attention", recompute_ratio=0.2, correction=0.0
    )
    assert strategy("epic-c0.3").config == BlendConfig("epic", correction=0.3)
    with pytest.raises(ValueError, match="'reuse' does not use 'correction'"):
        strategy("prefix-c0")  # nothing recomputed: no correction to set
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy("attention-0.2-c2")
    assert [s.name for s in parse_strategies("reuse,full")] == ["full", "reuse"]
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy("cacheblend-value-2")
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy("cacheblend-value-0.1-L0")
    with pytest.raises(ValueError, match="unknown strategy"):
        strategy("attention-1.5")


def test_prefix_strategy_uncaches_documents(engine):
    segments = engine.rag_segments("q?", ["doc one", "doc two"])
    prefix = strategy("prefix").segments(segments)
    assert [s.cache for s in prefix] == [True, False, False, False, False]
    assert [s.text for s in prefix] == [s.text for s in segments]


def test_synthetic_text_hits_the_target_length(engine):
    text = synthetic_text(engine.tokenizer, 200, seed=1)
    assert len(engine.tokenize(text)) == pytest.approx(200, abs=2)
    assert text == synthetic_text(engine.tokenizer, 200, seed=1)
    assert text != synthetic_text(engine.tokenizer, 200, seed=2)


def test_kl_divergence():
    import torch

    logits = torch.tensor([1.0, 2.0, 3.0])
    assert kl_divergence(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert kl_divergence(logits, torch.tensor([3.0, 2.0, 1.0])) > 0.5


def test_quality_runner_end_to_end(engine, tmp_path):
    items = generate_qa(2, seed=0, docs_per_prompt=(3, 3), styles=("record",))
    strategies = parse_strategies(
        "reuse,cacheblend-value-0.15,"
        "attention-0.2+lead_tokens=0+short_document=0+min_recompute=0+full_above=1+per_document=0"
    )
    out = tmp_path / "quality.json"
    result = run_quality(
        engine, items, strategies, max_new_tokens=3, output=out, log=lambda m: None
    )
    assert json.loads(out.read_text())["questions"] == 2
    summary = result["summary"]
    assert list(summary) == [
        "full",
        "reuse",
        "cacheblend-value-0.15",
        "attention-0.2+lead_tokens=0+short_document=0+min_recompute=0+full_above=1+per_document=0",
    ]
    assert summary["full"]["kl_mean"] == 0.0 and summary["full"]["agreement"] == 1.0
    assert summary["reuse"]["recompute_fraction"] == 0.0
    assert 0.1 < summary["cacheblend-value-0.15"]["recompute_fraction"] < 0.2
    blend = summary[
        "attention-0.2+lead_tokens=0+short_document=0+min_recompute=0+full_above=1+per_document=0"
    ]
    assert 0.15 < blend["recompute_fraction"] < 0.25
    assert summary["reuse"]["kl_mean"] > 0.0  # reused KV without its context differs
    assert summarize(result["rows"]) == summary
    full = {r["qid"]: r["answer"] for r in result["rows"] if r["strategy"] == "full"}
    for name, entry in summary.items():  # agreement: the answer equal to full prefill's
        mine = [r for r in result["rows"] if r["strategy"] == name]
        assert all(r["agrees"] == (r["answer"] == full[r["qid"]]) for r in mine)
        assert entry["agreement"] == sum(r["answer"] == full[r["qid"]] for r in mine) / len(mine)
        for qtype, typed in entry["by_type"].items():
            marks = [r["answer"] == full[r["qid"]] for r in mine if r["qtype"] == qtype]
            assert typed["agreement"] == sum(marks) / len(marks)
    assert all(t["agreement"] == 1.0 for t in summary["full"]["by_type"].values())


def test_quality_report_shows_agreement_from_the_rows(engine, tmp_path):
    from kvblend.bench.quality.qa_bench import quality_report
    from kvblend.bench.report import write_report

    items = generate_qa(3, seed=1, docs_per_prompt=(3, 3), styles=("record",))
    out = tmp_path / "quality.json"
    result = run_quality(engine, items, parse_strategies("reuse"), max_new_tokens=3,
                         output=out, log=lambda m: None)  # fmt: skip
    saved = json.loads(out.read_text())
    for entry in saved["summary"].values():  # a summary written before by-type agreement
        for typed in entry["by_type"].values():
            del typed["agreement"]
    out.write_text(json.dumps(saved))
    report = write_report(tmp_path / "no-ttft.json", out, tmp_path / "img")
    assert quality_report(result["summary"]) in report  # recomputed from the rows
    table = report.split("| agreement with full, by type |")[1]
    full_cells = {line.split(" | ")[2] for line in table.splitlines()[2:] if line.startswith("|")}
    assert full_cells == {"100%"}
    reuse = result["summary"]["reuse"]
    assert f"| reuse | {reuse['accuracy']:.1%} | " in report
    assert f"| {reuse['agreement']:.1%} | " in report


def test_ttft_runner_end_to_end(engine, tmp_path):
    strategies = parse_strategies("prefix,cacheblend-value-0.15,reuse")
    result = run_ttft(
        engine, lengths=[128], strategies=strategies, repeats=2, doc_tokens=48,
        decode_tokens=3, store_dir=tmp_path / "store", log=lambda m: None,
    )  # fmt: skip
    summary = {(s["strategy"], s["store"]): s for s in result["summary"]}
    assert set(summary) == {
        ("full", "memory"), ("prefix", "memory"), ("cacheblend-value-0.15", "memory"),
        ("reuse", "memory"), ("cacheblend-value-0.15", "disk"), ("prefix", "disk"),
        ("reuse", "disk"),
    }  # fmt: skip
    assert summary[("full", "memory")]["speedup_vs_full"] == 1.0
    assert summary[("full", "memory")]["runs"] == 2
    assert summary[("reuse", "disk")]["disk_vs_memory"] > 0
    assert summary[("reuse", "memory")]["compute_fraction"] < 0.5
    assert summary[("prefix", "memory")]["recompute_fraction"] == 0.0
    assert result["store"]["disk_bytes"] > 0 and result["store"]["document_tokens"] >= 96
    decode = [r for r in result["rows"] if r["store"] == "decode"]
    # 3 new tokens, the first from the prefill: 2 decoded (the tiny model emits no EOS here)
    assert [r["decode_tokens"] for r in decode] == [2, 2, 2, 2]
    assert summarize_ttft(result["rows"]) == result["summary"]


def test_doc_context_settings_name_their_strategy():
    from kvblend.bench.quality.doc_context import CONFIGS

    kinds = {"reuse": "reuse", "cb": "cacheblend", "att": "attention", "epic": "epic"}
    for name, config in CONFIGS.items():
        kind = next(k for k in kinds if name.startswith(k))
        assert config.strategy == kinds[kind], name

    def schedule(config):
        return config.ratio_schedule or ((config.check_layer, config.recompute_ratio),)

    assert schedule(CONFIGS["cb15L2"]) == ((2, 0.15),)
    assert schedule(CONFIGS["cb15L3"]) == ((3, 0.15),)
    assert schedule(CONFIGS["cb20L2"]) == ((2, 0.2),)
    assert schedule(CONFIGS["cbg30to15"]) == ((1, 0.3), (3, 0.15))
    assert CONFIGS["cbk15"].deviation == "key"


def test_doc_context_runner_end_to_end(engine, tmp_path):
    from kvblend.bench.quality.doc_context import run_doc_context

    items = generate_qa(2, seed=0, docs_per_prompt=(3, 3), styles=("record",))
    out = tmp_path / "doc_context.json"
    result = run_doc_context(engine, items, ["bos", "prefix"], ["reuse", "cb15L2"], out)
    assert json.loads(out.read_text())["questions"] == 2
    summary = {(s["context"], s["config"]): s for s in result["summary"]}
    assert list(summary) == [("-", "full"), ("bos", "reuse"), ("bos", "cb15L2"),
                             ("prefix", "reuse"), ("prefix", "cb15L2")]  # fmt: skip
    assert all(s["questions"] == 2 for s in summary.values())
    assert summary[("-", "full")]["kl"] == 0.0
    assert summary[("-", "full")]["agreement"] == 1.0
    rows = json.loads(out.read_text())["rows"]
    full = {r["qid"]: r["answer"] for r in rows if r["config"] == "full"}
    for row in rows:  # agreement is the answer equal to full prefill's, row by row
        assert row["agrees"] == (row["answer"] == full[row["qid"]])
    assert summary[("bos", "reuse")]["recompute_fraction"] == 0.0
    assert 0.1 < summary[("bos", "cb15L2")]["recompute_fraction"] < 0.2
    assert summary[("bos", "reuse")]["kl"] > 0.0  # documents precomputed without their context


def test_doc_context_agreement_from_answers_of_older_rows():
    from kvblend.bench.quality.doc_context import doc_context_table, summarize

    def row(qid, context, config, answer, **extra):
        return {"qid": qid, "context": context, "config": config, "correct": True, "kl": 0.0,
                "recompute_fraction": 0.0, "answer": answer, **extra}  # fmt: skip

    rows = [row("a", "-", "full", "Paris."), row("b", "-", "full", "Rome."),
            row("a", "prefix", "cb15", "Paris."), row("b", "prefix", "cb15", "Rome, Italy."),
            row("a", "prefix", "epic16", "Lyon.", agrees=True),  # a recorded mark wins
            row("b", "prefix", "epic16", "Rome.", agrees=False)]  # fmt: skip
    summary = {s["config"]: s for s in summarize(rows)}
    assert summary["full"]["agreement"] == 1.0
    assert summary["cb15"]["agreement"] == 0.5
    assert summary["epic16"]["agreement"] == 0.5
    unknown = [{k: v for k, v in r.items() if k != "answer"} for r in rows]
    assert summarize(unknown)[1]["agreement"] is None  # nothing recorded: no figure
    table = doc_context_table(summarize(unknown)).splitlines()
    assert table[0].count("agreement with full") == 1 and "| 0.000 | 0% |" in table[3]
    assert "| 100.0% | - | 0.000 |" in table[3]


def test_bench_cli_rejects_unknown_subcommand():
    with pytest.raises(SystemExit):
        bench_main(["nope"])


def test_benchmarks_with_their_own_options_are_bench_subcommands(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``kvblend bench NAME ...`` runs the module's own parser (every option reaches it), and
    ``kvblend bench --help`` lists each of them."""
    from kvblend.bench.cli import SCRIPTS, main

    for name in SCRIPTS:
        with pytest.raises(SystemExit) as exit_info:
            main([name, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: kvblend bench {name}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = capsys.readouterr().out
    assert all(name in listed for name in SCRIPTS)
    with pytest.raises(SystemExit) as exit_info:
        main(["entry-check", "--layout", "no-such-layout"])
    assert exit_info.value.code == 2 and "no-such-layout" in capsys.readouterr().err


def test_a_compiled_strategy_runs_its_prefills_through_the_compiled_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os

    from kvblend.bench.strategies import strategy
    from kvblend.blend.compiled import COMPILE_ENV, compile_loop

    plain, compiled = strategy("default"), strategy("default@compiled")
    assert compiled.compiled and not plain.compiled and compiled.config == plain.config
    assert strategy("cacheblend-value-0.15@compiled").config.strategy == "cacheblend"
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    with compiled.loop():
        assert compile_loop()
    assert COMPILE_ENV not in os.environ  # as it was
    monkeypatch.setenv(COMPILE_ENV, "0")
    with plain.loop():
        assert not compile_loop()  # a plain strategy follows the environment
    with compiled.loop():
        assert compile_loop()
    assert os.environ[COMPILE_ENV] == "0"
