"""The KV codec benchmarks: the quality run's shortcut and summary, the bytes table.

The quality run stores each codec's entries by encoding the full-precision entry it computed
once (`transcode`): that must be exactly what the codec's own precompute stores, or the run
would measure something users never get. Its summary pairs every codec with the full-precision
blend on the same questions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.bench.quality.codec_quality import (
    KL_MARGIN,
    codec_engines,
    codec_summary,
    codec_table,
    transcode,
)
from kvblend.bench.quality.shapes import shape_items
from kvblend.bench.speed.kv_codecs import bytes_table_rows, codecs_report, entry_files, run_decode
from kvblend.store import MemoryKVStore

DOCS = [
    "Doc one: Marta Quill lives in Lisbon and keeps bees on the roof of a printing house.",
    "Doc two: the orange cat sleeps all day by the window of the old bakery in Porto.",
]


def test_transcoded_entries_are_what_each_codec_precomputes() -> None:
    base = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    engines = codec_engines(base, ["none", "int8", "k8v4", "int4"])
    assert engines["none"] is base
    assert transcode(base, engines, DOCS) == 3 * len(DOCS)
    for name, engine in engines.items():
        alone = BlendEngine(base.model, base.tokenizer, store=MemoryKVStore(), kv_codec=name,
                            check_parity=False)  # fmt: skip
        for text in DOCS:
            key = alone.precompute([text])[0]
            assert key == engine.segment_id(text)
            own, stored = alone.store.get(key), engine.store.get(key)
            assert own is not None and stored is not None and set(own) == set(stored)
            assert all(torch.equal(own[n], stored[n]) for n in own), name
            assert engine.store.metadata(key) == alone.store.metadata(key)
    assert transcode(base, engines, DOCS) == 0  # already there


def test_codecs_are_paired_with_the_full_precision_blend() -> None:
    rows = []
    for index in range(20):
        full = {"qid": str(index), "shape": "qa", "strategy": "full", "correct": index < 10,
                "agrees": True, "kl": 0.0, "answer": "a", "ttft_s": 1.0,
                "compute_fraction": 1.0, "fallback": None}  # fmt: skip
        for codec, kl, answer in (("none", 0.02, "a"), ("int8", 0.021, "a"), ("int4", 0.04, "b")):
            rows.append({**full, "codec": codec})
            rows.append({**full, "codec": codec, "strategy": "default", "kl": kl,
                         "answer": answer, "correct": index < (10 if codec != "int4" else 4),
                         "agrees": answer == "a", "compute_fraction": 0.5,
                         "fallback": "full_above" if codec == "int4" else None})  # fmt: skip
    summary = {s["codec"]: s for s in codec_summary(rows)}
    assert summary["int8"]["kl_vs_none"] <= KL_MARGIN and summary["int8"]["accuracy_within_none_ci"]
    assert summary["int8"]["same_answer_as_none"] == 1.0
    assert summary["int4"]["kl_vs_none"] > KL_MARGIN
    assert summary["int4"]["difference_vs_none"] == -0.3
    assert summary["int4"]["same_answer_as_none"] == 0.0
    assert summary["int8"]["fallback_share"] == 0.0 and summary["int8"]["compute_mean"] == 0.5
    assert summary["int4"]["fallback_share"] == 1.0
    assert "| 0.50 | 100% | no |" in codec_table(list(summary.values()))
    # another blend strategy's rows are its own summary: none here
    assert codec_summary(rows, blend_strategy="default+min_recompute=0") == []


def test_the_bytes_table_and_entry_files(tmp_path: Path) -> None:
    base = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    rows = bytes_table_rows(["fp16", "int8"], ("tiny", 3, 2, 16))
    assert {r["codec"] for r in rows} == {"int8"} and all(0.5 < r["of_fp16"] < 0.7 for r in rows)
    files = {r["codec"]: r for r in entry_files(base, ["fp16", "none", "int8"], tmp_path)}
    assert files["fp16"]["of_fp16"] == 1.0 and 1.9 < files["none"]["of_fp16"] <= 2.0
    assert files["int8"]["of_fp16"] < 0.6


def test_the_decode_part_times_every_codec_and_k8v4s_first_version() -> None:
    base = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    rows = {r["codec"]: r for r in run_decode(base, ["none", "int8", "k8v4"], doc_tokens=40,
                                              rounds=3)}  # fmt: skip
    assert list(rows) == ["none", "int8", "k8v4", "k8v4 v1"]
    assert rows["none"]["vs_copy"] == 1.0 and all(len(r["ms"]) == 3 for r in rows.values())
    assert all(r["tok_s"] > 0 and r["tokens"] == 40 for r in rows.values())
    table = codecs_report({"machine": {"model": "tiny", "torch_threads": 1, "date": "d"},
                           "decode": list(rows.values())})  # fmt: skip
    assert "| k8v4 v1 | float32 | 40 |" in table


def test_an_unknown_part_is_refused() -> None:
    from kvblend.bench.speed.kv_codecs import main

    with pytest.raises(SystemExit):
        main(["--parts", "bytes,speed"])


def test_shards_share_a_shape_and_one_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two shards append their own questions' rows to one file, on every shape of the run; a
    run without a shard then finds every question done, computes nothing and summarizes them
    all. (The QA task's questions stand in for a second shape, which needs no data.)"""
    from kvblend.bench.quality import codec_quality
    from kvblend.bench.quality.codec_quality import read_rows, run_codec_quality

    monkeypatch.setattr(codec_quality, "shape_items", lambda base, shape, *args:
                        shape_items(base, "qa", *args))  # fmt: skip

    base = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    output = tmp_path / "codecs.json"
    ran = {}
    for shard in ((0, 2), (1, 2), (0, 1)):
        before = len(read_rows(output.with_suffix(".rows.jsonl")))
        result = run_codec_quality(base, ["qa", "long"], ["none", "int8"], data=None, questions=5,
                                   output=output, max_new_tokens=2, shard=shard,
                                   log=lambda message: None)  # fmt: skip
        ran[shard] = len(read_rows(output.with_suffix(".rows.jsonl"))) - before
    rows = read_rows(output.with_suffix(".rows.jsonl"))
    for shape in ("qa", "long"):
        assert len({row["qid"] for row in rows if row["shape"] == shape}) == 5
    assert ran[(0, 2)] == 2 * 3 * 4 and ran[(1, 2)] == 2 * 2 * 4 and ran[(0, 1)] == 0
    assert {(s["shape"], s["codec"]): s["n"] for s in result["summary"]} == {
        (shape, codec): 5 for shape in ("qa", "long") for codec in ("none", "int8")
    }
    with pytest.raises(ValueError, match="shard 2/2"):
        run_codec_quality(base, ["qa"], ["none"], data=None, questions=1, output=output,
                          shard=(2, 2))  # fmt: skip
