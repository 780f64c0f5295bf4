"""``kvblend bench vllm``: vLLM with kvblend's connector against vanilla vLLM, on one machine.

Both engines serve the same model folder (the bundled model's converted folder by default) with
prefix caching on. Documents of ``doc_tokens`` synthetic tokens are precomputed once by this
process into a store folder the connector then reads (``KVBLEND_STORE_DIR``), as a separate
ingestion job would; every prompt is a chat RAG prompt whose documents come in another order
than any earlier prompt's, so vLLM's prefix cache holds at most the prompt head. Measured:

- TTFT at each prompt length (repeated), and its ratio to vanilla vLLM's (the median of
  per-repeat ratios);
- requests/s with 1, 4 and 8 concurrent requests of ``rate_length`` tokens, ``rate_tokens``
  generated tokens each.

Both run at once as OpenAI-compatible servers (`server.VLLMServer`), and every prompt goes
to one then the other (alternating which goes first), so a load change on a shared machine
slows both alike; TTFT is the time to the first streamed token, as a client sees it. Run this
command with the Python of the environment vLLM is installed in (``.venv-vllm/bin/kvblend``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from kvblend.bench.speed.ttft import QUESTION, SYSTEM, build_documents, length_label

__all__ = ["run_vllm_bench", "serving", "vllm_table"]

DEFAULT_LENGTHS = (512, 1024, 2048, 4096, 7680)
CONCURRENCY = (1, 4, 8)
#: The stall test: one client streams `STREAM_TOKENS` tokens while `STALL_PROMPTS` RAG prompts of
#: `STALL_LENGTH` tokens arrive together, each answered with `STALL_TOKENS` tokens.
STREAM_TOKENS = 160
STALL_PROMPTS = 3
STALL_LENGTH = 4200
STALL_TOKENS = 16
STREAM_PROMPT = "Write a long story about a lighthouse keeper and the ships she guides home."


def _prompt(engine: Any, documents: Sequence[str]) -> str:
    return "".join(s.text for s in engine.rag_segments(QUESTION, documents, system=SYSTEM))


def build_jobs(
    engine: Any, lengths: Sequence[int], repeats: int, doc_tokens: int, rate_length: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """Return the TTFT prompts, the concurrent batches and every document to precompute.

    Every TTFT prompt has documents of its own (``doc_tokens``, or a quarter of a short prompt
    so that it holds at least four), in the reverse of the order they were stored in: no
    prompt shares more than the prompt head with an earlier one, so vLLM's prefix cache holds
    the head at most. The batches' prompts each start with a document of their own, drawn
    from a shared pool.
    """
    ttft, documents = [], []
    for length in lengths:
        size = max(32, min(doc_tokens, length // 4))
        for repeat in range(repeats):
            docs = build_documents(engine, length, size, seed=length * 100 + repeat)
            documents += docs
            ttft.append({"length": length, "repeat": repeat, "prompt": _prompt(engine, docs[::-1])})
    per_prompt = max(1, rate_length // doc_tokens)
    pool = build_documents(engine, sum(CONCURRENCY) * doc_tokens, doc_tokens, seed=rate_length + 7)
    documents += pool
    prompts = [
        _prompt(engine, [pool[(i + 5 * k) % len(pool)] for k in range(per_prompt)])
        for i in range(len(pool))
    ]
    rate, used = [], 0
    for concurrency in CONCURRENCY:
        rate.append({"prompts": prompts[used : used + concurrency]})
        used += concurrency
    return ttft, rate, documents


def build_stall_jobs(
    engine: Any, repeats: int, length: int, doc_tokens: int
) -> tuple[list[list[str]], list[str]]:
    """Return, per repeat, `STALL_PROMPTS` RAG prompts of ``length`` tokens, and their documents.

    Each prompt has documents of its own, in another order than stored.
    """
    rounds, documents = [], []
    for repeat in range(repeats):
        prompts = []
        for index in range(STALL_PROMPTS):
            docs = build_documents(engine, length, doc_tokens, seed=90_000 + 100 * repeat + index)
            documents += docs
            prompts.append(_prompt(engine, docs[::-1]))
        rounds.append(prompts)
    return rounds, documents


def _cached(usage: dict[str, Any] | None) -> int:
    details = (usage or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def time_ttft(
    servers: dict[str, Any], prompts: Sequence[dict[str, Any]], log: Any
) -> dict[str, list[dict[str, Any]]]:
    """Time each prompt on both servers, alternating which goes first."""
    from kvblend.bench.vllm.server import first_token

    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for number, item in enumerate(prompts):
        names = list(servers) if number % 2 == 0 else list(servers)[::-1]
        for name in names:
            timed = first_token(servers[name].url, item["prompt"])
            usage = timed["usage"] or {}
            rows[name].append(
                {
                    "length": item["length"],
                    "repeat": item["repeat"],
                    "ttft_s": timed["ttft_s"],
                    "prompt_tokens": usage.get("prompt_tokens"),
                    "num_cached_tokens": _cached(usage),
                }
            )
            log(
                f"{name} {length_label(item['length'])} repeat {item['repeat']}: "
                f"TTFT {timed['ttft_s']:.2f} s, {_cached(usage)} cached"
            )
    return rows


def time_rate(
    servers: dict[str, Any], batches: Sequence[dict[str, Any]], tokens: int, log: Any
) -> dict[str, list[dict[str, Any]]]:
    """Requests/s of each batch of concurrent prompts on each server, alternating the order."""
    from concurrent.futures import ThreadPoolExecutor

    from kvblend.bench.vllm.server import complete

    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for number, batch in enumerate(batches):
        names = list(servers) if number % 2 == 0 else list(servers)[::-1]
        for name in names:
            prompts = batch["prompts"]
            url = servers[name].url
            began = time.perf_counter()
            with ThreadPoolExecutor(len(prompts)) as pool:
                done = list(pool.map(functools.partial(complete, url, max_tokens=tokens), prompts))
            seconds = time.perf_counter() - began
            cached = sum(_cached(result.get("usage")) for result in done)
            rows[name].append(
                {
                    "concurrency": len(prompts),
                    "seconds": seconds,
                    "requests_s": len(prompts) / seconds,
                    "cached_tokens": cached,
                }
            )
            log(f"{name} {len(prompts)} concurrent: {len(prompts) / seconds:.3f} req/s")
    return rows


def stream_pauses(
    url: str,
    prompts: Sequence[str],
    *,
    stream_tokens: int = STREAM_TOKENS,
    prompt_tokens: int = STALL_TOKENS,
) -> dict[str, Any]:
    """Stream one completion; once it has produced tokens, send ``prompts`` together.

    Returns the stream's longest pause between two tokens after the prompts were sent, the
    seconds until every prompt was answered, and the stream's token count.
    """
    import json
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from kvblend.bench.vllm.server import MODEL_NAME, complete

    arrivals: list[float] = []
    started = threading.Event()
    body = {
        "model": MODEL_NAME,
        "prompt": STREAM_PROMPT,
        "max_tokens": stream_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=1800.0) as reply:
            reply.raise_for_status()
            for line in reply.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[len("data: ") :]).get("choices"):
                        arrivals.append(time.perf_counter())
                        if len(arrivals) >= 8:
                            started.set()
        started.set()

    streamer = threading.Thread(target=stream)
    streamer.start()
    started.wait(600)
    sent = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda prompt: complete(url, prompt, prompt_tokens), prompts))
    answered = time.perf_counter() - sent
    streamer.join()
    after = [t for t in arrivals if t >= sent]
    gaps = [b - a for a, b in zip([sent, *after], after, strict=False)]
    return {
        "longest_pause_s": max(gaps, default=0.0),
        "prompts_s": answered,
        "stream_tokens": len(arrivals),
    }


def time_stall(
    servers: dict[str, Any], rounds: Sequence[Sequence[str]], log: Any
) -> dict[str, list[dict[str, Any]]]:
    """Run the stall test on both servers, round by round, alternating which goes first."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    for number, prompts in enumerate(rounds):
        names = list(servers) if number % 2 == 0 else list(servers)[::-1]
        for name in names:
            row = stream_pauses(servers[name].url, prompts)
            rows[name].append(row)
            log(
                f"{name} stall round {number}: longest pause {row['longest_pause_s']:.2f} s, "
                f"{len(prompts)} prompts in {row['prompts_s']:.2f} s"
            )
    return rows


def reserved_cpus() -> str:
    """Return the cores both servers keep out of their forward's threads.

    ``$VLLM_CPU_NUM_OF_RESERVED_CPU``, else vanilla vLLM's own choice (1, for its scheduler
    process, on x86 with one rank).
    """
    return os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")


@contextlib.contextmanager
def busy_core(busy: bool) -> Iterator[None]:
    """Keep one core busy in a second process while the block runs (when ``busy``)."""
    if not busy:
        yield
        return
    import subprocess

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


def run_vllm_bench(
    model: str | None,
    *,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    repeats: int = 2,
    doc_tokens: int = 512,
    rate_length: int = 2048,
    rate_tokens: int = 16,
    work_dir: Path | None = None,
    busy: bool = False,
    stall_repeats: int = 2,
    rate: bool = True,
    dtype: str = "float32",
) -> dict[str, Any]:
    """Run both servers over the same prompts; return every measurement and a summary.

    ``busy``: a second process keeps one core busy for the whole run; ``stall_repeats``: rounds
    of the stall test (0: none); ``rate``: time requests/s too; ``dtype``: what both servers
    serve in (``float32`` or ``bfloat16``; the documents are precomputed in it).
    """
    load = [round(x, 2) for x in os.getloadavg()]
    folder, work, engine = bench_engine(model, work_dir, SYSTEM, dtype)
    ttft, batches, documents = build_jobs(engine, lengths, repeats, doc_tokens, rate_length)
    rounds, stall_documents = build_stall_jobs(engine, stall_repeats, STALL_LENGTH, doc_tokens)
    engine.precompute(documents + stall_documents)
    warmup = _prompt(engine, ["A short warm-up document."])
    config = {"system_prompt": SYSTEM}
    with (
        serving(folder, work, engine.context_window, warmup, config, dtype) as servers,
        busy_core(busy),
    ):
        ttft_rows = time_ttft(servers, ttft, log_line)
        stall_rows = time_stall(servers, rounds, log_line)
        rate_rows = time_rate(servers, batches if rate else [], rate_tokens, log_line)
    vanilla = {
        "ttft": ttft_rows["vanilla"],
        "rate": rate_rows["vanilla"],
        "stall": stall_rows["vanilla"],
    }
    kvblend = {
        "ttft": ttft_rows["kvblend"],
        "rate": rate_rows["kvblend"],
        "stall": stall_rows["kvblend"],
    }
    return {
        "model": str(folder),
        "doc_tokens": doc_tokens,
        "repeats": repeats,
        "rate_length": rate_length,
        "rate_tokens": rate_tokens,
        "work_dir": str(work),
        "busy_core": busy,
        "reserved_cpus": int(reserved_cpus()),
        "dtype": dtype,
        "load_average_at_start": load,
        "vanilla": vanilla,
        "kvblend": kvblend,
        "summary": summarize(vanilla, kvblend),
    }


def log_line(message: str) -> None:
    """Print a progress line to stderr."""
    print(message, file=sys.stderr, flush=True)


def bench_engine(
    model: str | None, work_dir: Path | None, system_prompt: str, dtype: str = "float32"
) -> tuple[Path, Path, Any]:
    """Return the model folder vLLM serves, the work folder, an engine over ``work / "store"``.

    The engine (with ``system_prompt``, in vLLM's ``dtype``) precomputes the documents the
    connector then reads, as a separate ingestion job would.
    """
    import torch

    from kvblend.engine.engine import BlendEngine
    from kvblend.models.loading import model_folder
    from kvblend.store import default_store

    folder = model_folder(model)
    work = Path(work_dir or tempfile.mkdtemp(prefix="kvblend-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    engine = BlendEngine.from_pretrained(
        str(folder),
        store=default_store(work / "store"),
        system_prompt=system_prompt,
        dtype=getattr(torch, dtype),
    )
    return folder, work, engine


@contextlib.contextmanager
def serving(
    folder: Path,
    work: Path,
    max_model_len: int,
    warmup: str,
    extra_config: dict[str, Any],
    dtype: str = "float32",
) -> Iterator[dict[str, Any]]:
    """Run vanilla vLLM and vLLM + `KVBlendConnector` (``extra_config``) over ``work / "store"``.

    Yields the two started `VLLMServer` by name (``vanilla``, ``kvblend``), each already asked
    ``warmup`` once (the connector claims nothing before its parity gate reports); stops both
    on exit. Their logs are ``work / "vanilla.log"`` and ``work / "kvblend.log"``.
    """
    from kvblend.bench.vllm.server import VLLMServer, complete

    env = {"KVBLEND_STORE_DIR": str(work / "store"), "TOKENIZERS_PARALLELISM": "false"}
    env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")
    # The same cores for both: vLLM's CPU build keeps cores out of its forward's thread pool for
    # its other processes, one more when any KV connector is set (for NIXL's), and on a machine
    # with no more cores than that it keeps none: on 2 cores vanilla vLLM's forward would run on
    # one thread and the connector's server's on two, a 2x gap that is not the blend's.
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = reserved_cpus()
    connector = {
        "kv_connector": "KVBlendConnector",
        "kv_connector_module_path": "kvblend.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": extra_config,
    }
    servers = {
        "vanilla": VLLMServer(
            str(folder), work / "vanilla.log", max_model_len=max_model_len, env=env, dtype=dtype
        ),
        "kvblend": VLLMServer(
            str(folder),
            work / "kvblend.log",
            max_model_len=max_model_len,
            env=env,
            kv_transfer_config=connector,
            dtype=dtype,
        ),
    }
    try:
        for server in servers.values():
            server.wait()
        for server in servers.values():
            complete(server.url, warmup, 1)
        yield servers
    finally:
        for server in servers.values():
            server.stop()


def summarize(vanilla: dict[str, Any], kvblend: dict[str, Any]) -> dict[str, Any]:
    """Median TTFT per length and its ratio to vanilla's; requests/s per concurrency."""
    rate = [
        {
            "concurrency": a["concurrency"],
            "vanilla_rps": b["requests_s"],
            "kvblend_rps": a["requests_s"],
            "ratio": a["requests_s"] / b["requests_s"],
        }
        for a, b in zip(kvblend["rate"], vanilla["rate"], strict=True)
    ]
    return {"ttft": _ttft(vanilla, kvblend), "rate": rate, "stall": _stall(vanilla, kvblend)}


def _ttft(vanilla: dict[str, Any], kvblend: dict[str, Any]) -> list[dict[str, Any]]:
    """Return each length's median TTFTs and the median ratio of each repeat's pair."""
    by_key = {(row["length"], row["repeat"]): row for row in vanilla["ttft"]}
    ttft = []
    for length in sorted({row["length"] for row in kvblend["ttft"]}):
        ours = [row for row in kvblend["ttft"] if row["length"] == length]
        theirs = [by_key[(row["length"], row["repeat"])] for row in ours]
        ttft.append(
            {
                "length": length,
                "prompt_tokens": ours[0]["prompt_tokens"],
                "vanilla_s": statistics.median(row["ttft_s"] for row in theirs),
                "kvblend_s": statistics.median(row["ttft_s"] for row in ours),
                "ratio": statistics.median(
                    a["ttft_s"] / b["ttft_s"] for a, b in zip(ours, theirs, strict=True)
                ),
                "cached_tokens": statistics.median(row["num_cached_tokens"] or 0 for row in ours),
            }
        )
    return ttft


def _stall(vanilla: dict[str, Any], kvblend: dict[str, Any]) -> dict[str, Any]:
    """Return the stall test's medians (the longest pause, the prompts' time) and ratios."""
    stall = {}
    if kvblend.get("stall"):
        for key in ("longest_pause_s", "prompts_s"):
            ours = [row[key] for row in kvblend["stall"]]
            theirs = [row[key] for row in vanilla["stall"]]
            stall[key] = {
                "vanilla": statistics.median(theirs),
                "kvblend": statistics.median(ours),
                "ratio": statistics.median(a / b for a, b in zip(ours, theirs, strict=True)),
            }
    return stall


def vllm_table(result: dict[str, Any]) -> str:
    """Markdown tables of a ``kvblend bench vllm`` result."""
    summary = result["summary"]
    lines = [
        "| prompt | vanilla vLLM TTFT | vLLM + kvblend TTFT | kvblend / vanilla | cached tokens |",
        "|---|---|---|---|---|",
    ]
    for row in summary["ttft"]:
        lines.append(
            f"| {length_label(row['length'])} ({row['prompt_tokens']} tokens) | "
            f"{row['vanilla_s']:.2f} s | {row['kvblend_s']:.2f} s | {row['ratio']:.2f} | "
            f"{row['cached_tokens']:.0f} |"
        )
    if summary["rate"]:
        lines += rate_table(result)
    stall = summary.get("stall")
    if stall:
        lines += [
            "",
            f"| one stream, {STALL_PROMPTS} RAG prompts of {STALL_LENGTH} tokens arriving together "
            "| vanilla vLLM | vLLM + kvblend | kvblend / vanilla |",
            "|---|---|---|---|",
        ]
        for key, label in (
            ("longest_pause_s", "stream's longest pause"),
            ("prompts_s", "prompts answered in"),
        ):
            row = stall[key]
            lines.append(
                f"| {label} | {row['vanilla']:.2f} s | {row['kvblend']:.2f} s | "
                f"{row['ratio']:.2f} |"
            )
    return "\n".join(lines)


def rate_table(result: dict[str, Any]) -> list[str]:
    """Return the lines of the requests/s table."""
    summary = result["summary"]
    lines = [
        "",
        f"| concurrent requests ({length_label(result['rate_length'])} tokens, "
        f"{result['rate_tokens']} generated) | vanilla vLLM req/s | vLLM + kvblend req/s | ratio |",
        "|---|---|---|---|",
    ]
    for row in summary["rate"]:
        lines.append(
            f"| {row['concurrency']} | {row['vanilla_rps']:.3f} | {row['kvblend_rps']:.3f} | "
            f"{row['ratio']:.2f}x |"
        )
    return lines
