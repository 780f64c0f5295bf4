"""``kvblend bench vllm``'s options reach both servers: the dtype they serve in."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvblend.bench.cli import build_parser
from kvblend.bench.vllm import server as vllm_server


def test_the_dtype_option_defaults_to_float32_and_takes_bfloat16() -> None:
    parser = build_parser()
    assert parser.parse_args(["vllm"]).dtype == "float32"
    assert parser.parse_args(["vllm", "--dtype", "bfloat16"]).dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["vllm", "--dtype", "float16"])


def test_a_server_is_started_with_the_dtype_asked(monkeypatch, tmp_path: Path) -> None:
    started: list[list[str]] = []

    class Popen:
        def __init__(self, command: list[str], **kwargs: Any) -> None:
            started.append(command)

    monkeypatch.setattr(vllm_server.subprocess, "Popen", Popen)
    for dtype in ("float32", "bfloat16"):
        server = vllm_server.VLLMServer("folder", tmp_path / f"{dtype}.log", max_model_len=64,
                                        dtype=dtype)  # fmt: skip
        server._log.close()
    assert [command[command.index("--dtype") + 1] for command in started] == [
        "float32", "bfloat16",
    ]  # fmt: skip
