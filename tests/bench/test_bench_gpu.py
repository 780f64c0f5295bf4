"""The GPU benchmark: its arguments and one short CPU run; the ingestion benchmark; tiny model.

The GPU figures themselves need a CUDA machine; here the same code path runs on the CPU with
tiny settings, as ``kvblend bench gpu --device cpu --lengths 1024 --dtype float32`` does.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.bench.cli import build_parser
from kvblend.bench.gpu import decode as bench_decode
from kvblend.bench.gpu import suite as gpu_suite
from kvblend.bench.gpu import suite_summary as gpu_suite_summary
from kvblend.bench.gpu.figures import DEFAULT_LENGTHS, gpu_table, parse_lengths, run_gpu
from kvblend.bench.speed.ingest import ingest_table, run_ingest
from kvblend.store import MemoryKVStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore(), name="tiny")


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
        for store in ("memory", "host", "disk")
        if name != "full" or store == "memory"
    }
    assert result["ttft"]["from_text"] and result["ttft"]["host"]
    for row in summary:  # timed from the string: the prompt handling is part of the TTFT
        assert 0 < row["prompt_s_median"] < row["ttft_median_s"]
        assert row["ttft_from_ids_median_s"] == pytest.approx(
            statistics.median(r["ttft_s"] - r["prompt_s"] for r in result["ttft"]["rows"]
                              if (r["target_tokens"], r["strategy"], r["store"])
                              == (row["target_tokens"], row["strategy"], row["store"]))
        )  # fmt: skip
    assert all(s["host_vs_memory"] > 0 for s in summary if s["store"] == "host")
    assert any("decode_tok_s_median" in s for s in summary)
    settings = [s["setting"] for s in result["ingest"]["summary"]]
    assert settings == ["one-by-one", "batched-400"]
    table = gpu_table(result)
    assert "cacheblend-value-0.15" in table and "batched-400" in table
    baseline = {(row["target_tokens"], row["run"]) for row in result["transformers"]}
    assert baseline == {
        (192, "transformers-forward"), (192, "transformers-forward-text"),
        (192, "transformers-generate"), (192, "transformers-generate-text"),
        (192, "transformers-decode"),
    }  # fmt: skip
    prompt_tokens = {row["prompt_tokens"] for row in result["transformers"]}
    assert prompt_tokens == {summary[0]["prompt_tokens"]}  # the same prompt on both sides
    decode = next(row for row in result["transformers"] if row["run"] == "transformers-decode")
    assert decode["decode_tokens"] == 3  # its rate is None when timing noise hides the decode
    assert "| transformers forward: text, ids |" in table
    json.dumps(result)  # what the command writes


def test_random_model_shapes() -> None:
    """The shapes are those of the named models; a tiny one runs a blend end to end."""
    from kvblend.bench.gpu.random_models import MODEL_SHAPES, random_model

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


def test_a_qwen2_shape_builds_a_qwen2_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvblend.bench.gpu.random_models import MODEL_SHAPES, random_model

    qwen = MODEL_SHAPES["qwen2.5-0.5b"]
    assert (qwen["num_hidden_layers"], qwen["hidden_size"], qwen["num_key_value_heads"]) == (
        24, 896, 2,
    )  # fmt: skip
    small = qwen | {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "vocab_size": 300}  # fmt: skip
    monkeypatch.setitem(MODEL_SHAPES, "small-qwen", small)
    model = random_model("small-qwen", byte_tokenizer(), torch.device("cpu"), torch.float32)
    assert (
        model.config.model_type == "qwen2"
        and model.model.layers[0].self_attn.q_proj.bias is not None
    )


# ---------------------------------------------------------------------- the GPU suite's summary
@pytest.fixture(scope="module")
def suite_results(engine: BlendEngine) -> dict:
    """A bench result and a decode result as their writers make them, on the tiny model."""
    from kvblend.bench.result_files import describe_machine

    suite = gpu_suite
    args = build_parser().parse_args(
        ["gpu", "--device", "cpu", "--dtype", "float32", "--lengths", "192", "--doc-tokens",
         "64", "--repeats", "1", "--decode-tokens", "3", "--no-disk", "--ingest-documents", "0",
         "--strategies", suite.STRATEGIES]
    )  # fmt: skip
    result = run_gpu(engine, args)
    result["machine"] = describe_machine(engine)  # as `kvblend bench gpu` writes it
    decode = bench_decode
    options = argparse.Namespace(threads=1, repeats=1, tokens=3)
    return {
        "gpu": result,
        "decode": decode.results(engine, options, decode.run(engine, [64], 3, 1)),
    }


def _scaled(result: dict, strategy: str, ttft_over_forward: float) -> None:
    """Set ``strategy``'s median TTFT to ``ttft_over_forward`` x transformers' forward (text)."""
    forward = next(r for r in result["transformers"] if r["run"] == "transformers-forward-text")
    for row in result["ttft"]["summary"]:
        if row["strategy"] == strategy and row["store"] == "memory":
            row["ttft_median_s"] = ttft_over_forward * forward["ttft_median_s"]


def test_the_summary_reports_met_not_met_and_missing(suite_results: dict, tmp_path: Path) -> None:
    summary = gpu_suite_summary
    eight = copy.deepcopy(suite_results["gpu"])
    _scaled(eight, "default", 0.30)  # met: <= 0.33
    _scaled(eight, "reuse", 0.20)  # not met: > 0.15
    _scaled(eight, "full", 1.05)  # met: within 1.1x
    generate = next(r for r in eight["transformers"] if r["run"] == "transformers-decode")
    default = next(r for r in eight["ttft"]["summary"] if r["strategy"] == "default")
    generate["decode_tok_s_median"] = 40.0  # a few tokens' timing on a busy CPU can be None
    default["decode_tok_s_median"] = 20.0  # not met: half of generate's
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (first / "gpu_llama8b.json").write_text(json.dumps(eight))
    steps = [{"name": "qwen", "status": "timed out after 300 s", "seconds": 300.0}]
    (first / "steps.json").write_text(json.dumps({"steps": steps}))
    (second / "decode.json").write_text(json.dumps(suite_results["decode"]))
    for kind in ("chunks", "flex"):
        (second / f"gpu_attention_{kind}.json").write_text(json.dumps(suite_results["gpu"]))

    result = summary.summarize([first, second], {"llama-8b": [192, 384], "qwen": [192]})
    status = {c["target"]: (c["status"], c["measured"]) for c in result["targets"]}
    met, measured = status["llama-8b 0.1875K: default <= 0.33 x transformers' forward"]
    assert met == "met" and measured == pytest.approx(0.30)  # 0.3 x a timed forward, / it
    assert status["llama-8b 0.1875K: reuse <= 0.15 x transformers' forward"][0] == "not met"
    assert status["llama-8b 0.1875K: kvblend full <= 1.1 x transformers' forward"][0] == "met"
    decode = status["llama-8b 0.1875K: decode after the default >= 1.0 x generate's tok/s"]
    assert decode[0] == "not met" and decode[1] == pytest.approx(0.5)
    missing = {c["target"]: c["detail"] for c in result["targets"] if c["status"] == "missing"}
    assert missing["llama-8b 0.375K: default <= 0.33 x transformers' forward"] == (
        "no default (memory) or forward row at 384"
    )
    assert missing["qwen 0.1875K: reuse <= 0.4 x transformers' forward"] == (
        "step qwen: timed out after 300 s"
    )
    assert missing["llama-8b 0.1875K: reuse <= 0.15 x transformers' forward, documents in the "
                   "disk tier"] == "no reuse (disk) or forward row at 192"  # fmt: skip
    tier = status["llama-8b 0.1875K: reuse <= 0.15 x transformers' forward, documents in the "
                  "host tier"]  # fmt: skip
    assert tier[0] in ("met", "not met") and tier[1] > 0  # the host tier was timed
    # 384 tokens: 2 targets x 3 tiers, full, decode; qwen the same; no disk tier at 192 (2)
    assert len(missing) == 8 + 8 + 2
    figures = "\n".join(result["figures"])
    assert "llama-8b 0.1875K default+probe_layers=0.25: TTFT" in figures
    assert "llama-8b 0.1875K: transformers forward " in figures
    assert "llama-8b 0.1875K reuse: from ids " in figures
    assert "decode (eager, tiny, compiled=False) " in figures
    assert "decode (compiled): step decode-compiled not run" in figures
    assert "attention 0.1875K default: flex" in figures
    assert "tests: step tests not run" in figures
    text = summary.write(result, tmp_path / "out")
    assert (
        "default <= 0.33 x transformers' forward, measured 0.300, met (tiny, cpu, float32)" in text
    )
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["targets"]


def test_the_summary_counts_a_junit_report(tmp_path: Path) -> None:
    """pytest's own junit report of a pass, a failure and a skip."""
    summary = gpu_suite_summary
    (tmp_path / "test_three.py").write_text(
        "import pytest\n\ndef test_a():\n    pass\n\ndef test_b():\n    assert False\n\n"
        "@pytest.mark.skip\ndef test_c():\n    pass\n"
    )
    report = tmp_path / "tests.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", "/dev/null",
         "--rootdir", str(tmp_path), f"--junitxml={report}", str(tmp_path / "test_three.py")],
        cwd=tmp_path, capture_output=True, check=False,
    )  # fmt: skip
    lines = summary.junit_figures({"tests.xml": report}, {})
    assert lines[0] == "tests (pytest): 1 passed, 1 failed, 0 errors, 1 skipped"
    assert lines[1].endswith("test_three::test_b")


def test_the_suite_plans_every_step_and_refuses_unknown_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite = gpu_suite
    options = {"quick": True, "qwen": None, "tokenizer": None}
    smoke = suite.plan_steps(argparse.Namespace(device="cpu", **options), tmp_path)
    names = [step.name for step in smoke]
    assert names == ["tests", "qwen", "llama-8b", "decode", "decode-compiled",
                     "attention-chunks", "attention-flex", "prefill-compiled"]  # fmt: skip
    options |= {"qwen": "q.gguf"}
    by_name = {s.name: s for s in suite.plan_steps(argparse.Namespace(device="cuda", **options),
                                                   tmp_path)}  # fmt: skip
    assert "--device" in by_name["tests"].argv and "cuda" in by_name["tests"].argv
    for step in ("qwen", "decode", "attention-flex"):
        assert by_name[step].argv[by_name[step].argv.index("--model") + 1] == "q.gguf"
    assert "llama-8b" in by_name["llama-8b"].argv and suite.STRATEGIES in by_name["llama-8b"].argv
    assert by_name["attention-flex"].env == {"KVBLEND_ATTENTION": "flex"}
    assert by_name["decode-compiled"].env == {"KVBLEND_DECODE_COMPILE": "1"}
    assert by_name["prefill-compiled"].env == {"KVBLEND_COMPILE": "1"}
    assert "tests/blend/test_compiled_loop.py" in by_name["tests"].argv
    # no Qwen file here: its runs and decode time random weights of its shape
    monkeypatch.setattr(suite, "qwen_model", lambda explicit: (None, "not there"))
    options |= {"qwen": None, "tokenizer": "tok"}
    by_name = {s.name: s for s in suite.plan_steps(argparse.Namespace(device="cuda", **options),
                                                   tmp_path)}  # fmt: skip
    for step in ("qwen", "decode", "attention-chunks"):
        argv = by_name[step].argv
        assert "--model" not in argv and argv[argv.index("--model-shape") + 1] == "qwen2.5-0.5b"
        assert argv[argv.index("--tokenizer") + 1] == str(Path("tok").resolve())
    with pytest.raises(SystemExit):
        suite.main(["--device", "cpu", "--steps", "nope", "--out", str(tmp_path)])


def test_a_shape_run_reads_a_tokenizer_folder_alone(tmp_path: Path) -> None:
    from kvblend.bench.gpu.figures import shape_tokenizer, shaped_engine

    byte_tokenizer().save_pretrained(tmp_path / "tok")
    args = build_parser().parse_args(["gpu", "--device", "cpu", "--dtype", "float32",
                                      "--model-shape", "tiny", "--tokenizer",
                                      str(tmp_path / "tok")])  # fmt: skip
    engine = shaped_engine(args)
    assert engine.tokenizer.encode("abc") == byte_tokenizer().encode("abc")
    assert engine.model.config.num_hidden_layers == 2
    with pytest.raises(ValueError, match="--tokenizer .*: not a tokenizer folder"):
        shape_tokenizer(None, str(tmp_path / "nothing"))


def test_each_step_runs_alone_within_its_limit_and_no_stale_result_survives(
    tmp_path: Path,
) -> None:
    suite = gpu_suite
    earlier = [{"name": "tests", "status": "ok", "seconds": 5.0}]
    (tmp_path / "steps.json").write_text(json.dumps({"steps": earlier}))
    (tmp_path / "decode.json").write_text("{}")  # an earlier run's result of a step run now
    steps = [
        suite.Step("tests", [sys.executable, "-c", "raise SystemExit(1)"], 60),  # not chosen
        suite.Step("decode", [sys.executable, "-c", "raise SystemExit(3)", "--name", "decode"], 60),
        suite.Step("qwen", [sys.executable, "-c", "import time; time.sleep(60)"], 1),
        suite.Step("llama-8b", [sys.executable, "-c", "print('ran')"], 60),
        suite.Step("decode-compiled", [sys.executable, "-c", "pass"], 60, cuda_only=True),
    ]
    args = argparse.Namespace(steps="decode,qwen,llama-8b,decode-compiled", budget=100)
    suite.run_all(steps, args, tmp_path, cuda=False, lengths=None)
    assert [s.status for s in steps[1:]] == [
        "failed (exit 3, see decode.log)", "timed out after 1 s", "ok", "skipped: no CUDA",
    ]  # fmt: skip
    assert not (tmp_path / "decode.json").exists()
    assert "ran" in (tmp_path / "llama-8b.log").read_text()
    records = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert [r["name"] for r in records] == [
        "tests",
        "decode",
        "qwen",
        "llama-8b",
        "decode-compiled",
    ]
    assert records[0] == earlier[0] and records[-1]["log"] == ""  # kept; never ran


def test_quick_and_each_part_of_a_full_run_fit_one_ten_minute_command(tmp_path: Path) -> None:
    """A GPU machine lends 10-minute commands: the step limits of each command add up to less."""
    suite = gpu_suite
    for quick in (True, False):
        options = argparse.Namespace(device="cuda", quick=quick, qwen="q.gguf", tokenizer=None)
        steps = {step.name: step for step in suite.plan_steps(options, tmp_path)}
        groups = [list(suite.QUICK_STEPS)] if quick else [p.split(",") for p in suite.PARTS]
        for group in groups:
            assert sum(steps[name].limit for name in group) <= 570, group
        if not quick:  # the three parts run every step once
            assert sorted(sum(groups, [])) == sorted(steps)
        tests = steps["tests"].argv
        assert tests[tests.index("-p") + 1] == "cuda_only" and "--device" in tests


def test_quick_runs_its_steps_only(tmp_path: Path) -> None:
    suite = gpu_suite
    steps = [suite.Step(name, [sys.executable, "-c", "pass"], 60)
             for name in (*suite.QUICK_STEPS, "decode")]  # fmt: skip
    args = argparse.Namespace(steps="", budget=400, quick=True)
    suite.run_all(steps, args, tmp_path, cuda=False, lengths=None)
    assert [step.status for step in steps] == ["ok", "ok", "ok", "not run"]
    records = json.loads((tmp_path / "steps.json").read_text())["steps"]
    assert [r["name"] for r in records] == list(suite.QUICK_STEPS)


def test_the_cuda_only_plugin_keeps_the_tests_with_a_cuda_path(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "import pytest\n\n@pytest.fixture\ndef compute_device():\n    return 'cpu'\n"
    )
    (tmp_path / "test_four.py").write_text(
        "import pytest\n\ndef test_device(compute_device):\n    pass\n\n"
        "@pytest.mark.skipif(False, reason='needs a CUDA device')\n"
        "def test_skipped():\n    pass\n\n"
        "def test_named():\n    assert 'cuda'\n\ndef test_plain():\n    pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "cuda_only", "-p", "no:cacheprovider", "-q",
         "--collect-only", "-c", "/dev/null", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT / "tests")},
    )  # fmt: skip
    assert "3/4 tests collected (1 deselected)" in result.stdout, result.stdout + result.stderr
    assert "test_plain" not in result.stdout
