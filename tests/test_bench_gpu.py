"""The GPU benchmark: its arguments and one short CPU run; the ingestion benchmark; tiny model.

The GPU figures themselves need a CUDA machine; here the same code path runs on the CPU with
tiny settings, as ``benchmarks/gpu.py --device cpu --lengths 1024 --dtype float32`` does.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.bench.cli import build_parser
from kvblend.bench.gpu import DEFAULT_LENGTHS, gpu_table, parse_lengths, run_gpu
from kvblend.bench.ingest import ingest_table, run_ingest
from kvblend.store import MemoryKVStore

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore(), name="tiny")


def wrapper():
    spec = importlib.util.spec_from_file_location("gpu_wrapper", ROOT / "benchmarks" / "gpu.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_arguments_default_to_cuda_bf16_and_the_four_lengths() -> None:
    args = build_parser().parse_args(["gpu"])
    assert (args.device, args.dtype, args.model_shape) == ("cuda", "bf16", None)
    assert (
        parse_lengths(args.lengths) == [4096, 8192, 16384, 32000] == parse_lengths(DEFAULT_LENGTHS)
    )
    for shape in ("llama-1b", "llama-8b"):
        assert build_parser().parse_args(["gpu", "--model-shape", shape]).model_shape == shape
    assert args.strategies == "full,default,cacheblend-value-0.15,reuse"
    smoke = build_parser().parse_args(["gpu", "--device", "cpu", "--lengths", "1024", "--dtype",
                                       "float32"])  # fmt: skip
    assert (smoke.device, smoke.dtype, parse_lengths(smoke.lengths)) == ("cpu", "float32", [1024])
    for bad in ("", "1024,x", "0"):
        with pytest.raises(ValueError, match="--lengths"):
            parse_lengths(bad)


def test_wrapper_picks_the_benchmark_model_only_off_the_cpu() -> None:
    module = wrapper()
    for argv in (["--device", "cpu"], ["--device=cpu", "--lengths", "1024"], ["--model", "m"]):
        assert module.default_model(list(argv)) == argv  # nothing fetched


def test_gpu_run_on_the_cpu(engine: BlendEngine, tmp_path: Path) -> None:
    args = build_parser().parse_args(
        ["gpu", "--device", "cpu", "--dtype", "float32", "--lengths", "192", "--doc-tokens",
         "64", "--repeats", "1", "--decode-tokens", "3", "--ingest-documents", "3",
         "--batch-tokens", "400", "--output", str(tmp_path / "gpu.json")]
    )  # fmt: skip
    result = run_gpu(engine, args)
    assert result["peak_gpu_mib"] is None  # not a CUDA device
    summary = result["ttft"]["summary"]
    assert {(s["strategy"], s["store"]) for s in summary} == {
        (name, store)
        for name in ("full", "default", "cacheblend-value-0.15", "reuse")
        for store in ("memory", "disk")
        if (name, store) != ("full", "disk")
    }
    assert any(s.get("decode_tok_s_median") for s in summary)
    settings = [s["setting"] for s in result["ingest"]["summary"]]
    assert settings == ["one-by-one", "batched-400"]
    table = gpu_table(result)
    assert "cacheblend-value-0.15" in table and "batched-400" in table
    baseline = {(row["target_tokens"], row["run"]) for row in result["transformers"]}
    assert baseline == {(192, "transformers-forward"), (192, "transformers-generate")}
    assert "| transformers forward |" in table
    json.dumps(result)  # what the command writes


def test_random_model_shapes() -> None:
    """The shapes are those of the named models; a tiny one runs a blend end to end."""
    from kvblend.bench.random_models import MODEL_SHAPES, random_model

    eight = MODEL_SHAPES["llama-8b"]
    assert (eight["num_hidden_layers"], eight["hidden_size"], eight["num_key_value_heads"]) == (
        32, 4096, 8,
    )  # fmt: skip
    assert MODEL_SHAPES["llama-1b"]["num_hidden_layers"] == 16
    tokenizer = byte_tokenizer()
    model = random_model("tiny", tokenizer, torch.device("cpu"), torch.float32)
    assert model.config.num_hidden_layers == 2 and model.dtype == torch.float32
    engine = BlendEngine(model, tokenizer, store=MemoryKVStore(), name="tiny-shape")
    assert engine.parity_error is not None and engine.parity_error < 1e-4


def test_ingest_runs_every_setting_interleaved(engine: BlendEngine) -> None:
    result = run_ingest(engine, documents=4, doc_tokens=40, batch_tokens=[100, 1000], repeats=2)
    assert [r["setting"] for r in result["rows"]] == [
        "one-by-one",
        "batched-100",
        "batched-1000",
    ] * 2
    baseline = next(s for s in result["summary"] if s["setting"] == "one-by-one")
    assert baseline["speedup_vs_one_by_one"] == 1.0
    assert all(s["docs_per_s_median"] > 0 for s in result["summary"])
    assert "| batched-1000 |" in ingest_table(result)
