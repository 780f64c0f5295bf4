"""What each ``kvblend bench`` subcommand runs: its engine, its benchmark, its result files.

Every ``cmd_*`` takes the parsed arguments of its subcommand (`kvblend.bench.cli.build_parser`),
loads the engine the way the docs tell users to (`kvblend.bench.engines.load_engine`), runs the
benchmark of its module (``kvblend.bench.speed.ttft``, ``quality.qa_bench``, ``quality.nq``...)
and writes the result as JSON, with the machine it ran on and the command that ran it, and as a
Markdown table beside it, which it also prints (`kvblend.bench.result_files.write_result`: the
results go to ``kvblend-bench/`` unless ``--output`` says otherwise).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvblend.bench.engines import load_engine
from kvblend.bench.result_files import RESULTS_DIR, describe_machine, write_result


def cmd_ttft(args: argparse.Namespace) -> None:
    """Time every strategy at every prompt length."""
    from kvblend.bench.speed.ttft import SYSTEM, run_ttft
    from kvblend.bench.speed.ttft_summary import ttft_table
    from kvblend.bench.strategies import parse_strategies

    strategies = parse_strategies(args.strategies)
    engine = load_engine(args, SYSTEM)
    lengths = [int(x) for x in args.lengths.split(",")]
    result = run_ttft(
        engine,
        lengths=lengths,
        strategies=strategies,
        repeats=args.repeats,
        doc_tokens=args.doc_tokens,
        disk=not args.no_disk,
        disk_strategies=args.disk_strategies.split(",") if args.disk_strategies else None,
        decode_tokens=args.decode_tokens,
        seed=args.seed,
        transformers=not args.no_transformers,
    )
    result["machine"] = describe_machine(engine)
    write_result(result, Path(args.output), ttft_table(result["summary"]))


def default_name() -> str:
    """Return the default config in words, e.g. ``attention 0.4/0.15`` (early / later ratio)."""
    from kvblend.blend.config import BlendConfig

    config = BlendConfig()
    if config.strategy == "attention" and config.early_layers > 0:
        return f"attention {config.early_ratio:g}/{config.recompute_ratio:g}"
    if config.strategy in ("attention", "cacheblend"):
        return f"{config.strategy} {config.recompute_ratio:g}"
    return config.strategy


def cmd_figures(args: argparse.Namespace) -> None:
    """Print the figures: 8 x 512-token documents, cacheblend 0.15 and the default vs full."""
    from kvblend.bench.speed.ttft import SYSTEM, run_ttft
    from kvblend.bench.speed.ttft_summary import ttft_table
    from kvblend.bench.strategies import parse_strategies

    engine = load_engine(args, SYSTEM)
    result = run_ttft(
        engine,
        lengths=[args.docs * 512],
        strategies=parse_strategies("cacheblend-value-0.15,default"),
        repeats=args.repeats,
        doc_tokens=512,
        decode_tokens=0,
    )
    result["machine"] = describe_machine(engine)
    summary = {(s["strategy"], s["store"]): s for s in result["summary"]}
    full = summary[("full", "memory")]
    blend = summary[("cacheblend-value-0.15", "memory")]
    default = summary[("default", "memory")]
    disk = summary.get(("default", "disk"))
    lines = [
        f"{args.docs} documents x 512 tokens + question ({full['prompt_tokens']} prompt tokens), "
        f"{args.repeats} interleaved repeats, medians:",
        f"  full prefill TTFT             {full['ttft_median_s']:.3f} s",
        f"  cacheblend 0.15 TTFT (memory) {blend['ttft_median_s']:.3f} s  "
        f"-> blended/full = {blend['ttft_vs_full']:.3f} (target <= 0.25)",
        f"  default ({default_name()}) TTFT (memory) "
        f"{default['ttft_median_s']:.3f} s  "
        f"-> blended/full = {default['ttft_vs_full']:.3f} (target <= 0.333)",
    ]
    if disk is not None:
        lines.append(
            f"  default TTFT (disk)           {disk['ttft_median_s']:.3f} s  "
            f"-> disk/memory = {disk['disk_vs_memory']:.2f} (target <= 1.25)"
        )
    store = result["store"]
    lines.append(
        f"  store size per 1,000 document tokens: memory {store['memory_mib_per_1k_tokens']:.1f} "
        f"MiB, disk {store['disk_mib_per_1k_tokens'] or 0:.1f} MiB"
    )
    text = "\n".join(lines)
    write_result(result, Path(args.output), text + "\n\n" + ttft_table(result["summary"]))


def cmd_quality(args: argparse.Namespace) -> None:
    """Accuracy and fidelity of every strategy on the generated QA task."""
    from kvblend.bench.quality.qa import SYSTEM_PROMPT, generate_qa
    from kvblend.bench.quality.qa_bench import quality_report, run_quality
    from kvblend.bench.quality.stats import paired_table, strategy_stats
    from kvblend.bench.strategies import parse_strategies
    from kvblend.blend.config import BlendConfig

    items = generate_qa(args.questions, seed=args.seed)
    strategies = parse_strategies(args.strategies)
    engine = load_engine(args, SYSTEM_PROMPT)
    meta = {
        "machine": describe_machine(engine),
        "seed": args.seed,
        "doc_prefix": engine.doc_prefix,
        "default_config": repr(BlendConfig()),
    }
    result = run_quality(
        engine,
        items,
        strategies,
        max_new_tokens=args.max_new_tokens,
        output=Path(args.output),
        meta=meta,
    )
    result["paired"] = strategy_stats(result["rows"], seed=args.seed)
    write_result(
        result,
        Path(args.output),
        quality_report(result["summary"])
        + "\n\nPaired with full prefill (bootstrap over questions):\n\n"
        + paired_table(result["paired"]),
    )


def cmd_ingest(args: argparse.Namespace) -> None:
    """Documents/s of precompute, one by one vs batched."""
    from kvblend.bench.speed.ingest import ingest_table, run_ingest
    from kvblend.bench.speed.ttft import SYSTEM

    engine = load_engine(args, SYSTEM)
    result = run_ingest(
        engine,
        documents=args.documents,
        doc_tokens=args.doc_tokens,
        batch_tokens=[int(x) for x in args.batch_tokens.split(",")],
        repeats=args.repeats,
        seed=args.seed,
    )
    result["machine"] = describe_machine(engine)
    write_result(result, Path(args.output), ingest_table(result))


def cmd_gpu(args: argparse.Namespace) -> None:
    """TTFT, decode speed, peak memory and ingestion on one device (a GPU, or a CPU smoke run)."""
    from kvblend.bench.gpu.figures import gpu_table, run_gpu, shaped_engine
    from kvblend.bench.speed.ttft import SYSTEM

    engine = shaped_engine(args) if args.model_shape else load_engine(args, SYSTEM)
    result = run_gpu(engine, args)
    result["machine"] = describe_machine(engine)
    write_result(result, Path(args.output), gpu_table(result))


def cmd_plan(args: argparse.Namespace) -> None:
    """Time tokenizing and matching a string prompt against the tokenizer alone."""
    from kvblend.bench.speed.planning import planning_line, run_planning, tokenizer_engine
    from kvblend.models.loading import load_model, resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    _, tokenizer = load_model(resolve_model(args.model), torch.device("cpu"), torch.float32)
    engine = tokenizer_engine(tokenizer)
    result = run_planning(engine, args.tokens, args.doc_tokens, args.repeats, args.nq)
    print(planning_line(result))


#: ``--doc-prefix`` / ``--heads`` choices: the engines to build, not told or told the prompt head.
HEAD_CHOICES = {"auto": ["untold"], "head": ["told"], "both": ["told", "untold"], "bos": ["bos"]}


def _heads_engines(args: argparse.Namespace, head_text: Any) -> dict[str, Any]:
    """Build the engines ``--doc-prefix`` names.

    ``auto``: the engine's defaults (not told the prompts' head); ``head``: told it; ``both``;
    ``bos``: documents behind BOS alone.
    """
    from kvblend.bench.quality.compare import engines_for
    from kvblend.engine.engine import DEFAULT_SYSTEM_PROMPT

    base = load_engine(args, DEFAULT_SYSTEM_PROMPT)
    return engines_for(base, HEAD_CHOICES[args.doc_prefix], head_text(base.tokenizer))


def _meta(args: argparse.Namespace, engine: Any) -> dict[str, Any]:
    from kvblend.blend.config import BlendConfig

    return {
        "machine": describe_machine(engine),
        "default_config": repr(BlendConfig()),
        "max_new_tokens": args.max_new_tokens,
    }


def cmd_nq(args: argparse.Namespace) -> None:
    """Every strategy on NQ-open questions over retrieved Wikipedia passages (resumable)."""
    from kvblend.bench.quality.baselines import BaselineCache
    from kvblend.bench.quality.nq import nq_head
    from kvblend.bench.quality.nq_eval import RunOptions, run_decided, shard_path
    from kvblend.bench.stopping import StopRequest
    from kvblend.bench.strategies import parse_strategies

    strategies = parse_strategies(args.strategies)
    engines = _heads_engines(args, nq_head)
    engine = next(iter(engines.values()))
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    ks = [int(k) for k in args.k.split(",")]
    if args.write_prompts:  # the split's questions, as a run would ask them
        _write_nq_prompts(args, engines, ks, cache_dir)
        return
    output = Path(args.output)
    shard = _nq_shard(args.shard)
    if args.fresh and output.exists():
        output.unlink()
    cache = None if args.no_baselines else BaselineCache(args.baselines)
    options = RunOptions(args.max_new_tokens, args.kl_only, args.time_every)
    with StopRequest() as stop:
        result = run_decided(
            engines,
            args.data,
            strategies,
            ks=ks,
            split=args.split,
            questions=args.questions,
            offset=args.offset,
            seed=args.seed,
            gold_at=args.gold_at,
            labels=args.labels,
            options=options,
            cache=cache,
            shard=shard,
            cache_dir=cache_dir,
            output=output,
            meta=_meta(args, engine),
            log=lambda message: print(
                time.strftime("%H:%M:%S ") + message, file=sys.stderr, flush=True
            ),
            stop=stop,
        )
    if shard[1] > 1:  # a shard's own file; the run without --shard writes OUTPUT
        output = shard_path(output, shard)
    write_result(result, output, _nq_report(args, engine.name, result))


def _write_nq_prompts(
    args: argparse.Namespace, engines: dict[str, Any], ks: list[int], cache_dir: Path | None
) -> None:
    """Write the prompts of ``--split``'s questions, as a run would ask them, to a JSONL file."""
    from kvblend.bench.quality.nq import load_nq, run_nq
    from kvblend.bench.quality.nq_eval import split_questions

    total = sum(1 for _ in load_nq(args.data)[1])
    start, _ = split_questions(args.split, args.offset, args.questions, total)
    written = run_nq(
        engines,
        args.data,
        [],
        ks=ks,
        questions=args.questions,
        offset=start,
        seed=args.seed,
        gold_at=args.gold_at,
        cache_dir=cache_dir,
        prompts_file=Path(args.write_prompts),
    )
    recall = ", ".join(f"{v:.0%}" for v in written["recall"].values())
    print(f"wrote {written['prompts']} prompts to {args.write_prompts} (gold retrieved: {recall})")


def _nq_shard(text: str) -> tuple[int, int]:
    """Return ``--shard K/N`` as ``(K, N)``; exit with one line unless ``0 <= K < N``."""
    shard = tuple(int(part) for part in text.split("/")) if "/" in text else ()
    if len(shard) != 2 or not 0 <= shard[0] < shard[1]:
        raise SystemExit(f"kvblend bench nq: --shard {text!r}: give K/N with 0 <= K < N")
    return shard[0], shard[1]


def _nq_report(args: argparse.Namespace, model: str, result: dict[str, Any]) -> str:
    """Return the NQ run's title and tables: answers, closeness, by head and by gold place."""
    from kvblend.bench.quality.closeness import closeness_table
    from kvblend.bench.quality.nq_eval import decided_table, stopped_note
    from kvblend.bench.strategies import FLOOR

    recall = ", ".join(f"{v:.0%}" for v in result["recall"].values())
    title = (
        f"NQ-open, {model} ({result['dtype']}), {result['split']} questions "
        f"{result['file_range'][0]}-{result['file_range'][1] - 1} of the file, k = {args.k}, "
        f"gold {args.gold_at} (gold retrieved: {recall})"
    )
    if note := stopped_note(result):
        title += f"; {note}"
    places = ("k", "head", "place")
    table = decided_table(result["summary"], ("k", "head"))
    if result["by_place"]:
        table += "\n\nBy gold place:\n\n" + decided_table(result["by_place"], places)
    table += (
        "\n\nAgreement with full prefill, and as a multiple of bfloat16 rounding's "
        f"({FLOOR}: full prefill computed in bfloat16, decoded in {result['dtype']}):\n\n"
        + closeness_table(result["summary"], ("k", "head"))
    )
    if result["by_place"]:
        table += "\n\nBy gold place:\n\n" + closeness_table(result["by_place"], places)
    return title + "\n\n" + table


def cmd_shapes(args: argparse.Namespace) -> None:
    """Every strategy on every prompt shape, engines told and not told the prompt head."""
    from kvblend.bench.quality.compare import summary_table
    from kvblend.bench.quality.shapes import parse_shapes, run_shapes
    from kvblend.bench.strategies import parse_strategies
    from kvblend.engine.engine import DEFAULT_SYSTEM_PROMPT

    shapes = parse_shapes(args.shapes)
    strategies = parse_strategies(args.strategies)
    args.doc_prefix = "bos" if args.heads == "bos" else "auto"
    base = load_engine(args, DEFAULT_SYSTEM_PROMPT)
    result = run_shapes(
        base,
        shapes,
        strategies,
        data=args.data,
        questions=args.questions,
        seed=args.seed,
        gold_at=args.gold_at,
        max_new_tokens=args.max_new_tokens,
        heads=HEAD_CHOICES[args.heads],
        cache_dir=Path(args.cache_dir) if args.cache_dir else None,
        output=Path(args.output),
        meta=_meta(args, base),
        log=lambda message: print(message, file=sys.stderr),
    )
    title = f"Every prompt shape, {base.name}, {args.questions} questions per shape"
    write_result(
        result,
        Path(args.output),
        title + "\n\n" + summary_table(result["summary"], ("shape", "head")),
    )


def cmd_report(args: argparse.Namespace) -> None:
    """Tables and plots from saved results."""
    from kvblend.bench.report import write_report

    print(write_report(Path(args.ttft), Path(args.quality), Path(args.img_dir)))
    if args.closeness:
        from kvblend.bench.report import plot_closeness

        results = [json.loads(Path(name).read_text()) for name in args.closeness.split(",")]
        print(f"wrote {plot_closeness(results, Path(args.img_dir) / 'closeness.png')}")


def cmd_registry(args: argparse.Namespace) -> None:
    """Search cost of the document registry at several registry sizes."""
    from kvblend.bench.speed.registry import registry_table, run_registry

    counts = tuple(int(x) for x in args.counts.split(","))
    result = run_registry(counts, docs_in_prompt=args.docs_in_prompt, repeats=args.repeats)
    result["machine"] = {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    write_result(result, Path(args.output), registry_table(result))


def cmd_doc_context(args: argparse.Namespace) -> None:
    """Blend settings with documents precomputed behind BOS, the prompt head or the chat head."""
    from kvblend.bench.quality.doc_context import (
        doc_context_items,
        doc_context_table,
        run_doc_context,
    )
    from kvblend.bench.quality.qa import SYSTEM_PROMPT

    engine = load_engine(args, SYSTEM_PROMPT)
    items = doc_context_items(args.questions, seed=args.seed)
    result = run_doc_context(
        engine, items, args.contexts.split(","), args.configs.split(","), Path(args.output)
    )
    result["machine"], result["seed"] = describe_machine(engine), args.seed
    write_result(result, Path(args.output), doc_context_table(result["summary"]))


def cmd_redis_ttft(args: argparse.Namespace) -> None:
    """TTFT with documents from memory, a cold disk and Redis; four-process Redis throughput."""
    from kvblend.bench.speed.redis_ttft import redis_server, redis_table, run_redis_ttft
    from kvblend.bench.speed.ttft import SYSTEM

    with redis_server(args.redis_url) as url:
        engine = load_engine(args, SYSTEM)
        result = run_redis_ttft(
            engine,
            url,
            length=args.length,
            doc_tokens=args.doc_tokens,
            repeats=args.repeats,
            rounds=args.rounds,
        )
    result["machine"] = describe_machine(engine)
    write_result(result, Path(args.output), redis_table(result["summary"]))


def _vllm_machine() -> dict[str, Any]:
    return {
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
    }


def cmd_vllm(args: argparse.Namespace) -> None:
    """TTFT and requests/s of vLLM with kvblend's connector against vanilla vLLM (or ``--nq``)."""
    from kvblend.bench.vllm.speed import run_vllm_bench, vllm_table

    if args.nq:
        from kvblend.bench.vllm.nq import run_vllm_nq, vllm_nq_table

        output = Path(args.output or RESULTS_DIR / "vllm_nq.json")
        result = run_vllm_nq(
            args.model,
            Path(args.nq),
            questions=args.questions,
            max_new_tokens=args.max_new_tokens,
            seed=args.seed,
            work_dir=Path(args.work_dir) if args.work_dir else None,
            output=output,
        )
        result["machine"] = _vllm_machine()
        write_result(result, output, vllm_nq_table(result))
        return

    lengths = [int(x) for x in args.lengths.split(",")]
    result = run_vllm_bench(
        args.model,
        lengths=lengths,
        repeats=args.repeats,
        doc_tokens=args.doc_tokens,
        rate_length=args.rate_length,
        rate_tokens=args.rate_tokens,
        work_dir=Path(args.work_dir) if args.work_dir else None,
        busy=args.busy_core,
        stall_repeats=args.stall_repeats,
        rate=not args.no_rate,
        dtype=args.dtype,
    )
    result["machine"] = _vllm_machine()
    write_result(result, Path(args.output or RESULTS_DIR / "vllm.json"), vllm_table(result))
