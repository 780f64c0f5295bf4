"""The README's vLLM commands run as written: store, precompute, server, then one RAG request.

The block under "## vLLM" is run with bash, in a fresh folder (``.venv-vllm``
linked there, so the relative paths hold), with two differences only: its first line, the
install script, is left out when ``.venv-vllm`` exists (CI's ``.ci/run`` has just run it), and
the server gets a free port (``--port``) instead of 8000, which another server may hold. The
server then answers a chat RAG prompt of the sample documents it was told to precompute, and
docs/vllm.md's metrics example (the bash block under "## Metrics", a ``curl`` of ``/metrics``)
shows every kvblend metric, counting that request as its record says.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import MISSING_DEPENDENCY

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
INSTALL = "bash scripts/install_vllm.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=f"{MISSING_DEPENDENCY}vLLM environment: bash scripts/install_vllm.sh",
    ),
]


def bash_block(path: Path, heading: str) -> list[str]:
    """Return the lines of the first bash block under ``heading`` in ``path``."""
    text = path.read_text("utf-8")
    section = text[text.index(f"\n{heading}\n") :]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    assert block is not None, f"no bash block under {heading!r} in {path.name}"
    return block.group(1).rstrip("\n").splitlines()


def readme_vllm_block() -> list[str]:
    """Return the lines of the README's first bash block under "## vLLM"."""
    return bash_block(ROOT / "README.md", "## vLLM")


#: The metrics docs/vllm.md's example shows, each with a sample (`KVBlendPromMetrics`).
METRICS = [
    f"vllm:kvblend_{name}"
    for name in (
        "blended_requests_total", "vllm_requests_total", "prompt_tokens_total",
        "prefix_cached_tokens_total", "reused_tokens_total", "computed_tokens_total",
        "recomputed_tokens_total", "escalated_tokens_total", "blend_seconds_count",
        "blend_seconds_sum",
    )
]  # fmt: skip


def scraped(port: int) -> dict[str, float]:
    """Run docs/vllm.md's metrics example against the server on ``port``; its samples."""
    command = "\n".join(bash_block(ROOT / "docs" / "vllm.md", "## Metrics"))
    assert "curl" in command and "localhost:8000/metrics" in command, command
    command = command.replace("localhost:8000", f"127.0.0.1:{port}")
    done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
    samples: dict[str, float] = {}
    for line in done.stdout.splitlines():
        name, _, value = line.rpartition(" ")
        samples[re.sub(r'(engine|model_name)="[^"]*",?', "", name).replace("{}", "")] = float(value)
    return samples


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_the_readme_block_sets_up_a_store_and_a_server() -> None:
    lines = readme_vllm_block()
    assert lines[0].split("#")[0].strip() == INSTALL
    assert any(line.startswith("export KVBLEND_STORE_DIR=") for line in lines)
    assert any(" precompute " in line for line in lines)
    server = "\n".join(lines[lines.index(next(x for x in lines if "api_server" in x)) :])
    assert server.startswith("VLLM_CPU_KVCACHE_SPACE=") and "KVBlendConnector" in server


def test_the_readme_commands_run_as_written(tmp_path: Path) -> None:
    import httpx

    from kvblend.samples import sample_corpus

    lines = readme_vllm_block()
    if (ROOT / ".venv-vllm").exists():
        lines = lines[1:]  # the install script: CI has run it
    (tmp_path / ".venv-vllm").symlink_to((ROOT / ".venv-vllm").resolve())
    (tmp_path / "scripts").symlink_to(ROOT / "scripts")
    port = _free_port()
    lines[-1] += f" --port {port}"  # the server's command ends the block
    script = "set -euo pipefail\n" + "\n".join(lines) + "\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HF_HUB_OFFLINE": "1"}
    env.pop("KVBLEND_STORE_DIR", None)
    env.pop("KVBLEND_REDIS_URL", None)
    log_path = tmp_path / "server.log"
    with log_path.open("w", encoding="utf-8") as log:
        server = subprocess.Popen(
            ["bash", "-c", script], cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if server.poll() is not None:
                pytest.fail(f"the README's commands stopped ({server.returncode}):\n"
                            f"{log_path.read_text('utf-8', 'replace')[-4000:]}")  # fmt: skip
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2.0)
        else:
            pytest.fail("the README's server did not answer /health in 15 minutes")
        corpus = sample_corpus()
        documents = [document["text"] for document in corpus["documents"]][::-1]
        messages = [{"role": "system", "content": "Answer the question using only the documents."},
                    {"role": "user", "content": "Documents:\n\n" + "\n\n".join(documents)
                     + "\n\nQuestion: " + corpus["questions"][0]["question"]}]  # fmt: skip
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        body = {"model": models["data"][0]["id"], "messages": messages, "max_tokens": 8,
                "temperature": 0.0}  # fmt: skip
        reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["choices"][0]["message"]["content"].strip()
        record = (answer.get("kv_transfer_params") or {}).get("kvblend")
        assert record is not None and "forecast_vllm_s" in record, answer
        for _ in range(20):  # the step's stats reach /metrics just after the answer
            samples = scraped(port)
            if samples.get("vllm:kvblend_prompt_tokens_total"):
                break
            time.sleep(0.5)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    log = log_path.read_text("utf-8", "replace")
    assert "precomputed 8 new documents" in log
    store = tmp_path / ".kvblend-store"
    assert f"kvblend: store disk {store}: 8 entries of model" in log, log[-3000:]
    assert "kvblend: parity gate passed" in log
    assert json.dumps(record)  # the record the server returned is plain JSON
    assert all(any(key.startswith(name) for key in samples) for name in METRICS), samples
    blended = record["fallback"] is None
    assert samples["vllm:kvblend_blended_requests_total"] == int(blended)
    if not blended:
        assert samples[f'vllm:kvblend_vllm_requests_total{{reason="{record["reason"]}"}}'] == 1
    assert samples["vllm:kvblend_prompt_tokens_total"] == record["prompt_tokens"]
    reused = record["cached_tokens"] - record["vllm_prefix_tokens"]
    assert samples["vllm:kvblend_reused_tokens_total"] == reused
    assert samples["vllm:kvblend_recomputed_tokens_total"] == record["recomputed_tokens"]
    assert samples["vllm:kvblend_escalated_tokens_total"] == 0
