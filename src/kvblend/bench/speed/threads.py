"""Blend vs full prefill TTFT by CPU thread count, on an idle or a busy machine.

The prompt is the README's LangChain chain's: six of the sample corpus's eight profiles (the
``k=6`` a retriever returns, in another order per question), in its ``PromptTemplate`` and the
model's chat template, as a string in which the engine finds the precomputed documents. Each
question is answered to its first token (``max_new_tokens=1``) with full prefill and with the
default blend, under two thread counts: torch's own default (one per physical core, what
kvblend left in place before it chose) and kvblend's
(`kvblend.engine.torch_threads.default_threads`: the cores the last minute's load leaves idle),
read after the burners started. Repeats
interleave every setting. ``--busy N`` starts N processes that each burn a CPU for the run (and
waits ``--settle`` seconds first, so the load average sees them); they are stopped at the end.
Appends the run to ``threads.json`` in the results folder (``kvblend-bench/``) and prints a
table.

    kvblend bench threads [--busy 1] [--repeats 5] [--settle 60] [--label busy]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import statistics
import time
from typing import Any

import torch

from kvblend import BlendConfig, BlendEngine
from kvblend.bench.result_files import RESULTS_DIR
from kvblend.engine.torch_threads import default_threads, physical_cores
from kvblend.samples import sample_corpus
from kvblend.store import MemoryKVStore

TEMPLATE = "Answer from the documents.\n\nDocuments:\n{context}\n\nQuestion: {question}"


def burn() -> None:
    """Keep one CPU busy until terminated."""
    while True:
        pass


def prompts(engine: BlendEngine, count: int, documents: int) -> list[str]:
    """Return ``count`` chat RAG prompts over ``documents`` sample documents each."""
    corpus = sample_corpus()
    texts = [d["text"] for d in corpus["documents"]]
    questions = [q["question"] for q in corpus["questions"]]
    rng = random.Random(0)
    out = []
    for index in range(count):
        picked = rng.sample(texts, documents)
        context = "\n\n".join(picked)
        question = questions[index % len(questions)]
        user = TEMPLATE.format(context=context, question=question)
        out.append(engine.apply_chat_template([{"role": "user", "content": user}]))
    return out


def ttft(engine: BlendEngine, prompt: str, config: BlendConfig) -> float:
    """Return the TTFT of ``prompt`` (one new token)."""
    return engine.generate(prompt, config, max_new_tokens=1).ttft_s


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Return the run: TTFT at each thread count, with ``--busy`` processes burning CPUs."""
    torch_default = torch.get_num_threads()
    burners = [multiprocessing.Process(target=burn, daemon=True) for _ in range(args.busy)]
    for process in burners:
        process.start()
    try:
        if burners:
            time.sleep(args.settle)  # the 1-minute load average catches up with the burners
        load_before = os.getloadavg()[0]
        kvblend_default = default_threads()
        engine = BlendEngine.from_pretrained(store=MemoryKVStore(), threads=torch_default)
        corpus = [d["text"] for d in sample_corpus()["documents"]]
        engine.precompute(corpus, progress=False)
        texts = prompts(engine, args.questions, args.documents)
        settings = {"torch default": torch_default, "kvblend default": kvblend_default}
        fallbacks, times = _time_settings(engine, texts, settings, args.repeats)
        load_after = os.getloadavg()[0]
    finally:
        for process in burners:
            process.terminate()
            process.join()
    rows = []
    for name, threads in settings.items():
        full = statistics.median(times[(name, "full")])
        blend = statistics.median(times[(name, "default")])
        rows.append(
            {
                "threads": name,
                "count": threads,
                "full_ttft_s": full,
                "blend_ttft_s": blend,
                "blend_over_full": blend / full,
            }
        )
    return {
        "label": args.label or ("busy" if args.busy else "idle"),
        "burners": args.busy,
        "cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "load_average_1m": [round(load_before, 2), round(load_after, 2)],
        "prompt_tokens": len(engine.encode(texts[0])),
        "questions": args.questions,
        "repeats": args.repeats,
        "fallbacks": sorted(str(f) for f in fallbacks),
        "rows": rows,
    }


def _time_settings(
    engine: BlendEngine, texts: list[str], settings: dict[str, int], repeats: int
) -> tuple[set[Any], dict[tuple[str, str], list[float]]]:
    """Time full prefill and the default at each thread count, interleaved, after a warm-up.

    Returns the prompts' fallbacks (why a prompt was not blended) and the TTFTs by (thread
    setting, config).
    """
    configs = {"full": BlendConfig("full"), "default": BlendConfig()}
    for threads in set(settings.values()):  # warm-up of each thread count
        torch.set_num_threads(threads)
        for config in configs.values():
            ttft(engine, texts[0], config)
    times: dict[tuple[str, str], list[float]] = {}
    fallbacks = {engine.prefill(text).stats.fallback for text in texts}
    for _ in range(repeats):
        for name, threads in settings.items():
            torch.set_num_threads(threads)
            for text in texts:
                for config_name, config in configs.items():
                    times.setdefault((name, config_name), []).append(ttft(engine, text, config))
    return fallbacks, times


def table(run: dict[str, Any]) -> str:
    """Return the markdown table of a run."""
    lines = [
        f"{run['label']}: {run['burners']} burner(s), {run['cpus']} CPUs, load average "
        f"{run['load_average_1m'][0]} -> {run['load_average_1m'][1]}, "
        f"{run['prompt_tokens']} prompt tokens",
        "| threads | count | full TTFT (s) | blend TTFT (s) | blend / full |",
        "|---|---|---|---|---|",
    ]
    for row in run["rows"]:
        lines.append(
            f"| {row['threads']} | {row['count']} | {row['full_ttft_s']:.2f} | "
            f"{row['blend_ttft_s']:.2f} | {row['blend_over_full']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark: ``kvblend bench threads [options]``."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench threads", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--busy", type=int, default=0, help="processes burning a CPU each")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds before measuring")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--documents", type=int, default=6)
    parser.add_argument("--label", default=None)
    args = parser.parse_args(argv)
    run = measure(args)
    print(table(run))
    path = RESULTS_DIR / "threads.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    runs = json.loads(path.read_text()) if path.exists() else []
    runs.append(run)
    path.write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
    main()
