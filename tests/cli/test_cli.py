"""The ``kvblend`` command line on the bundled model: demo, ask, precompute, store, errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvblend import BlendConfig
from kvblend.cli.main import main


@pytest.mark.slow
def test_demo_answers_with_full_and_blended_prefill(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--memory-only", "--questions", "1"]) == 0
    out = capsys.readouterr().out
    assert "Q: What is the name of Marta Quill's dog?" in out
    assert "full prefill  TTFT" in out and "blended       TTFT" in out
    # the demo's questions are ones full prefill answers right on the bundled model
    assert "Expected answer found: full prefill 1/1" in out
    assert " reused, " in out and " recomputed, " in out and " computed" in out


@pytest.mark.slow
def test_precompute_ask_and_store_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "marta.txt").write_text("Marta Quill is a beekeeper who lives in Lisbon.\n")
    (docs / "tomas.md").write_text("Tomas Elm is a violin maker who lives in Cremona.\n")
    store = str(tmp_path / "store")
    system = ["--system", "Answer from the documents."]
    assert main(["precompute", str(docs), "--store-dir", store, *system]) == 0
    assert "precomputed 2 new documents" in capsys.readouterr().out
    assert main(["store", "stats", "--store-dir", store]) == 0
    assert "entries: 2" in capsys.readouterr().out
    code = main(
        ["ask", "Where does Marta Quill live?", "--docs", str(docs), "--store-dir", store,
         "--max-new-tokens", "12", *system]
    )  # fmt: skip
    captured = capsys.readouterr()
    assert code == 0 and captured.out.strip()
    assert "reused" in captured.err
    # explain, in a new engine over the same store: the documents are known from the store
    prompt = "Context: Tomas Elm is a violin maker who lives in Cremona.\nWho makes violins?"
    assert main(["explain", prompt, "--store-dir", store, *system]) == 0
    explained = capsys.readouterr().out
    assert "1 document(s) found (2 known)" in explained
    # a one-line document is recomputed whole by default, as prefill does, and explain says so
    # (it said "0 reused from caches" and, for the same document, "moved: reused at its new
    # position")
    assert "0 reused, " in explained and "recomputed whole (short_document" in explained
    assert "reused at its new position" not in explained
    assert main(["store", "clear", "--store-dir", store]) == 0
    # two documents + the prompt head: ask found the documents precompute stored (same system
    # prompt, so the same document context and segment ids)
    assert "cleared 3 entries" in capsys.readouterr().out
    assert main(["store", "stats", "--store-dir", store]) == 0
    assert "entries: 0" in capsys.readouterr().out


def test_missing_documents_are_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["ask", "question?", "--docs", str(tmp_path / "nowhere"), "--memory-only"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("kvblend: error: no such file or folder") and "Traceback" not in err


def test_bad_ratio_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--memory-only", "--ratio", "1.5"])
    captured = capsys.readouterr()
    assert code == 2 and "recompute_ratio must be a number in [0, 1]" in captured.err
    assert "loaded" not in captured.out + captured.err  # refused before loading the model


def test_bad_correction_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["demo", "--memory-only", "--correction", "-0.1"])
    captured = capsys.readouterr()
    assert code == 2 and "correction must be a number in [0, 1]" in captured.err
    assert "Traceback" not in captured.err


def test_only_the_blend_settings_given_reach_the_config() -> None:
    from argparse import Namespace

    from kvblend import BlendConfig
    from kvblend.cli.main import _config

    unset = {"ratio": None, "deviation": None, "correction": None}
    assert _config(Namespace(strategy="epic", **unset)) == BlendConfig("epic")
    given = Namespace(strategy="cacheblend", ratio=0.3, deviation="key", correction=None)
    assert _config(given) == BlendConfig("cacheblend", recompute_ratio=0.3, deviation="key")


def _one_line_error(captured: pytest.CaptureFixture[str], code: int, loads: bool = False) -> str:
    """The error line of a refused command; ``loads``: refused while loading the model."""
    out = captured.readouterr()
    lines = out.err.strip().splitlines()
    if loads:  # the progress line, then the error
        assert lines[0].startswith("loading model"), out.err
        lines = lines[1:]
    assert code == 2, out.err
    assert len(lines) == 1 and lines[0].startswith("kvblend"), out.err
    assert "Traceback" not in out.err and "loaded" not in out.out + out.err
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here: not a mistake")
def test_cuda_on_a_cpu_only_torch_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, main(["demo", "--memory-only", "--device", "cuda"]))
    assert "--device cuda:" in err and "use --device cpu" in err


@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu", "unknown device 'gpu'"), ("cuda:99", "cuda:99"), ("meta", "unsupported device")],
)
def test_unusable_devices_are_one_line(
    capsys: pytest.CaptureFixture[str], device: str, message: str
) -> None:
    err = _one_line_error(capsys, main(["ask", "q?", "--docs", ".", "--device", device]))
    assert message in err


def test_bench_help_and_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvblend bench") and "ttft" in out and "quality" in out
    err = _one_line_error(capsys, main(["bench"]))
    assert "choose a command: " in err
    for command in ("ttft", "figures", "quality", "ingest", "gpu", "registry", "report"):
        assert command in err
    assert "bench" in _one_line_error(capsys, main([]))
    err = _one_line_error(capsys, main(["bench", "quality", "--device", "gpu", "--questions", "1"]))
    assert "unknown device 'gpu'" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--questions", "0"],
        ["demo", "--questions", "many"],
        ["demo", "--max-new-tokens", "0"],
        ["ask", "q?"],
        ["demo", "--strategy", "nope"],
        ["demo", "--dtype", "int8"],
    ],
)
def test_bad_options_are_one_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    _one_line_error(capsys, main([*argv, "--memory-only"]))


@pytest.mark.slow
def test_dtype_loads_the_model_in_it_and_keys_its_entries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Documents precomputed in bf16 are found by a bf16 reader, not by the fp32 default."""
    from kvblend.cli import main as cli_main

    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "marta.txt").write_text("Marta Quill is a beekeeper who lives in Lisbon.\n" * 8)
    store = str(tmp_path / "store")
    assert main(["precompute", str(docs), "--store-dir", store, "--dtype", "bf16"]) == 0
    capsys.readouterr()
    loaded = []
    engine_of = cli_main._engine

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        engine = engine_of(*args, **kwargs)
        loaded.append(engine)
        return engine

    prompt = "Context: " + (docs / "marta.txt").read_text() + "Where does Marta live?"
    for dtype in ("bf16", "fp32"):
        cli_main._engine = recorded
        try:
            assert main(["explain", prompt, "--store-dir", store, "--dtype", dtype]) == 0
        finally:
            cli_main._engine = engine_of
        explained = capsys.readouterr().out
        found = "1 document(s) found" if dtype == "bf16" else "0 document(s) found"
        assert found in explained, explained
    assert [engine.decoder.dtype for engine in loaded] == [torch.bfloat16, torch.float32]


def test_questions_zero_names_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, main(["demo", "--memory-only", "--questions", "0"]))
    assert "--questions: must be at least 1" in err


def test_undecodable_question_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line_error(capsys, main(["ask", "Wh\udcffere?", "--docs", ".", "--memory-only"]))
    assert "the question argument is not valid Unicode" in err


@pytest.mark.slow
def test_non_utf8_arguments_from_the_shell_are_one_line(tmp_path: Path) -> None:
    env = os.environ | {"PYTHONPATH": os.pathsep.join(sys.path), "LC_ALL": "C.UTF-8"}
    bad = b"Wh\xffere?"
    for argv in (
        [b"ask", bad, b"--docs", str(tmp_path).encode(), b"--memory-only"],
        [b"ask", b"q?", b"--docs", bytes(tmp_path) + b"/\xfe.txt", b"--memory-only"],
    ):
        done = subprocess.run(
            [sys.executable.encode(), b"-m", b"kvblend.cli.main", *argv], env=env,
            capture_output=True, timeout=300,
        )  # fmt: skip
        err = done.stderr.decode("utf-8")
        assert done.returncode == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("kvblend: error:") and "Traceback" not in err


def test_unknown_hub_id_offline_fails_at_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "doc.txt").write_text("Marta lives in Lisbon.")
    argv = ["ask", "q?", "--docs", str(tmp_path), "--memory-only", "--model", "nobody/no-model"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    err = _one_line_error(capsys, main(argv), loads=True)
    assert "not in the local Hugging Face cache and the hub cannot be reached" in err
    # not marked offline, but the hub endpoint refuses connections: the same, without retries
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    err = _one_line_error(capsys, main(argv), loads=True)
    assert "hub cannot be reached" in err


@pytest.mark.slow
def test_non_utf8_files_are_skipped_with_a_warning_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "marta.txt").write_text("Marta Quill is a beekeeper who lives in Lisbon.\n")
    (docs / "latin1.txt").write_bytes("Tomás Elm vive em Cremona.\n".encode("latin-1"))
    (docs / "binary.md").write_bytes(b"\xff\xfe\x00garbage")
    code = main(["precompute", str(docs), "--store-dir", str(tmp_path / "store")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "precomputed 1 new document in" in captured.out and "2 skipped" in captured.out
    warnings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("skipping")]
    assert len(warnings) == 2 and all("not UTF-8 text" in line for line in warnings)


def test_only_undecodable_files_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "latin1.txt").write_bytes("Tomás".encode("latin-1"))
    err = _one_line_error(capsys, main(["precompute", str(tmp_path), "--memory-only"]))
    assert err.startswith("kvblend: error: no documents found")
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [
        f"skipping {tmp_path / 'latin1.txt'}"
    ]


def test_a_flag_the_strategy_does_not_use_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["demo", "--memory-only", "--strategy", "epic", "--ratio", "0.3"])
    captured = capsys.readouterr()
    assert code == 2 and "strategy 'epic' does not use --ratio" in captured.err
    assert "Traceback" not in captured.err and "loaded" not in captured.out + captured.err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--set", "lead_tokens"], "a setting is NAME=VALUE"),
        (["--set", "lead_tokens=many"], "lead_tokens must be a non-negative int"),
        (["--strategy", "epic", "--set", "lead_tokens=4"], "'epic' does not use 'lead_tokens'"),
        (["--ratio", "0.3", "--set", "recompute_ratio=0.2"], "recompute_ratio is given twice"),
    ],
)
def test_set_reaches_every_setting_and_a_bad_one_is_a_one_line_error(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["demo", "--memory-only", *flags])
    captured = capsys.readouterr()
    assert code == 2 and message in captured.err
    assert "Traceback" not in captured.err and "loaded" not in captured.out + captured.err


def test_set_values_become_the_config() -> None:
    from kvblend.cli.main import _config, build_parser

    args = build_parser().parse_args(
        ["ask", "Q?", "--docs", "d.txt", "--set", "lead_tokens=16", "--set", "full_above=1"]
    )
    assert _config(args) == BlendConfig(lead_tokens=16, full_above=1.0)
