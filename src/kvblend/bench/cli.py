"""``kvblend bench`` subcommands, one per benchmark.

The benchmarks with options of their own (`SCRIPTS`) are their modules' ``main``:
``kvblend bench decode ARGS`` is ``python -m kvblend.bench.gpu.decode ARGS``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvblend.bench.commands import (
    HEAD_CHOICES,
    cmd_doc_context,
    cmd_figures,
    cmd_gpu,
    cmd_ingest,
    cmd_nq,
    cmd_plan,
    cmd_quality,
    cmd_redis_ttft,
    cmd_registry,
    cmd_report,
    cmd_shapes,
    cmd_ttft,
    cmd_vllm,
)
from kvblend.bench.result_files import RECORDED_DIR, RESULTS_DIR

if TYPE_CHECKING:
    from kvblend.command_line import OneLineParser

    Subcommands = argparse._SubParsersAction[OneLineParser]  # noqa: SLF001

#: Benchmarks that parse their own options: the subcommand, its module and what it measures.
SCRIPTS = {
    "batch": ("kvblend.bench.speed.batch", "requests/s of batched requests vs one by one"),
    "decode": ("kvblend.bench.gpu.decode", "decode tokens/s from the static vs the dynamic cache"),
    "entry-check": (
        "kvblend.bench.speed.entry_check",
        "what checking a stored entry costs (no model)",
    ),
    "threads": ("kvblend.bench.speed.threads", "TTFT by torch thread count on a busy CPU"),
    "gpu-tier": ("kvblend.bench.gpu.tier", "TTFT from a host vs a GPU memory tier (CUDA)"),
    "gpu-suite": ("kvblend.bench.gpu.suite", "every GPU figure owed, a process per step (CUDA)"),
    "codecs": (
        "kvblend.bench.speed.kv_codecs",
        "bytes, precompute/read speed per tier, TTFT per KV codec",
    ),
    "codec-quality": ("kvblend.bench.quality.codec_quality", "accuracy and KL of every KV codec"),
    "guard": (
        "kvblend.bench.quality.guard_calibration",
        "guard signals vs answers unlike full's, limits",
    ),
}


def run_script(name: str, argv: Sequence[str]) -> int:
    """Run the `SCRIPTS` benchmark ``name`` with its own options ``argv``."""
    code = importlib.import_module(SCRIPTS[name][0]).main(list(argv))
    return int(code or 0)


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser of ``kvblend bench``: a subcommand per benchmark."""
    from kvblend.command_line import OneLineParser

    parser = OneLineParser(prog="kvblend bench", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


#: ``nq``'s and ``shapes``' strategies by default (full prefill, the baseline, first).
NQ_STRATEGIES = "full,default,cacheblend-value-0.15,epic,reuse,attention-0.3"


def _model_options(p: argparse.ArgumentParser, dtype: str = "auto") -> None:
    """Add the model's options; ``dtype``: the default of ``--dtype`` (quality: float32)."""
    p.add_argument(
        "--model",
        help="model folder, GGUF file or hub id, or a benchmark model's name (qwen2.5-0.5b, "
        "qwen2.5-1.5b: the file scripts/bench_models.py writes) (default: bundled)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--dtype",
        default=dtype,
        help="auto, float32, bf16, fp16 (default %(default)s; auto: the "
        "engine's default, bf16 where the device has bfloat16 matrix "
        "units unless the checkpoint is float32, else float32; the quality "
        "benchmarks measure in float32, the exact reference)",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--seed", type=int, default=0)


def _retrieval_options(p: argparse.ArgumentParser, required: bool) -> None:
    """Add the options of the benchmarks over NQ-open passages (``required``: ``--data``)."""
    p.add_argument(
        "--data",
        required=required,
        help="NQ jsonl(.gz): question, answers, title, text per line",
    )
    p.add_argument("--cache-dir", default=None, help="corpus embeddings cache (default: kvblend's)")
    p.add_argument("--strategies", default=NQ_STRATEGIES, help="comma list; full runs first")
    p.add_argument(
        "--engine-system",
        default=None,
        help="the system prompt of the engine not told the head",
    )
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument(
        "--gold-at",
        choices=["retrieved", "random", "places"],
        default="retrieved",
        help="gold passage where the retriever ranked it (put in at a random "
        "place when missed), always at a random place, or first, middle "
        "or last by the question (a third each; `nq`'s default)",
    )


def _add_ttft(sub: Subcommands) -> None:
    """Add ``ttft``: TTFT of every strategy at several prompt lengths."""
    ttft = sub.add_parser("ttft", help="TTFT of every strategy at several prompt lengths")
    _model_options(ttft)
    ttft.add_argument("--lengths", default="1024,2048,4096,7680", help="prompt tokens, comma list")
    ttft.add_argument(
        "--strategies",
        default="all",
        help="comma list or 'all' (full, prefix, cacheblend-value|key-RATIO, epic, "
        "reuse); full is always run first",
    )
    ttft.add_argument("--repeats", type=int, default=3)
    ttft.add_argument("--doc-tokens", type=int, default=512)
    ttft.add_argument("--no-disk", action="store_true", help="skip the cold-disk runs")
    ttft.add_argument(
        "--disk-strategies",
        default="default,reuse",
        help="also timed from the cold disk tier ('' for all)",
    )
    ttft.add_argument("--decode-tokens", type=int, default=16, help="0 to skip decode speed")
    ttft.add_argument("--output", default=str(RESULTS_DIR / "ttft.json"))
    ttft.add_argument(
        "--quick", action="store_true", help="1K and 2K tokens, 4 strategies, 3 repeats"
    )
    ttft.add_argument(
        "--no-transformers",
        action="store_true",
        help="skip the transformers row: plain AutoModelForCausalLM on the same "
        "checkpoint and dtype, chat template and generate(max_new_tokens=1) "
        "on the same text, the user's baseline",
    )
    ttft.set_defaults(func=cmd_ttft)


def _add_figures(sub: Subcommands) -> None:
    """Add ``figures``: the figures at 8 x 512-token documents."""
    figures = sub.add_parser("figures", help="the 8 x 512-token figures of issues 2 and 3")
    _model_options(figures)
    figures.add_argument("--docs", type=int, default=8)
    figures.add_argument("--repeats", type=int, default=5)
    figures.add_argument("--output", default=str(RESULTS_DIR / "figures.json"))
    figures.set_defaults(func=cmd_figures)


def _add_quality(sub: Subcommands) -> None:
    """Add ``quality``: accuracy and KL of every strategy on the generated QA task."""
    quality = sub.add_parser("quality", help="accuracy and KL of every strategy on the QA task")
    _model_options(quality, dtype="float32")
    quality.add_argument("--questions", type=int, default=200)
    quality.add_argument(
        "--strategies",
        default="default,reuse,epic,attention-0.1,"
        "attention-0.15,attention-0.3,attention-0.2-c0,cacheblend-value-0.05,"
        "cacheblend-value-0.1,cacheblend-value-0.15,cacheblend-value-0.2,"
        "cacheblend-value-0.3,cacheblend-key-0.15,cacheblend-key-0.3,"
        "cacheblend-value-0.2-c0.5",
    )
    quality.add_argument(
        "--doc-prefix",
        choices=["auto", "bos"],
        default="auto",
        help="what documents are precomputed behind: the prompt head (auto, "
        "the engine default) or the BOS token alone",
    )
    quality.add_argument(
        "--engine-system",
        default=None,
        help="the engine's system prompt, when it should differ from the one "
        "in the prompts (measures an unconfigured engine)",
    )
    quality.add_argument("--max-new-tokens", type=int, default=12)
    quality.add_argument("--output", default=str(RESULTS_DIR / "quality.json"))
    quality.set_defaults(func=cmd_quality)


def _add_ingest(sub: Subcommands) -> None:
    """Add ``ingest``: documents/s of precompute, one by one vs batched."""
    ingest = sub.add_parser("ingest", help="documents/s of precompute, one by one vs batched")
    _model_options(ingest)
    ingest.add_argument("--documents", type=int, default=16)
    ingest.add_argument("--doc-tokens", type=int, default=512)
    ingest.add_argument(
        "--batch-tokens",
        default="2048,4096,8192",
        help="token budgets of the batched runs, comma list",
    )
    ingest.add_argument("--repeats", type=int, default=3)
    ingest.add_argument("--output", default=str(RESULTS_DIR / "precompute.json"))
    ingest.set_defaults(func=cmd_ingest)


def _add_gpu(sub: Subcommands) -> None:
    """Add ``gpu``: TTFT, decode, peak memory and ingestion on one device."""
    from kvblend.bench.gpu.figures import add_gpu_arguments

    gpu = sub.add_parser("gpu", help="TTFT, decode, peak memory and ingestion on a GPU in bf16")
    _model_options(gpu)
    add_gpu_arguments(gpu)
    gpu.set_defaults(func=cmd_gpu)


def _add_plan(sub: Subcommands) -> None:
    """Add ``plan``: tokenizing and matching a string prompt vs the tokenizer."""
    from kvblend.bench.speed.planning import add_plan_arguments

    plan = sub.add_parser("plan", help="tokenizing and matching a string prompt vs the tokenizer")
    _model_options(plan)
    add_plan_arguments(plan)
    plan.set_defaults(func=cmd_plan)


def _add_ops(sub: Subcommands) -> None:
    """Add ``ops``: aten ops per layer and host syncs of a prefill."""
    from kvblend.bench.speed.ops import add_ops_arguments, cmd_ops

    ops = sub.add_parser("ops", help="aten ops per layer and host syncs of a prefill (CPU)")
    add_ops_arguments(ops)
    ops.set_defaults(func=cmd_ops)


def _add_headline(sub: Subcommands) -> None:
    """Add ``headline``: the figures tables from the recorded results."""
    from kvblend.bench.headline import add_headline_arguments, cmd_headline

    headline = sub.add_parser(
        "headline", help="the README's figures table from benchmarks/results (print/write/check)"
    )
    add_headline_arguments(headline)
    headline.set_defaults(func=cmd_headline)


def _add_nq(sub: Subcommands) -> None:
    """Add ``nq``: accuracy and KL on NQ-open over retrieved passages."""
    nq = sub.add_parser("nq", help="accuracy and KL on NQ-open over retrieved passages")
    _model_options(nq, dtype="float32")
    _retrieval_options(nq, required=True)
    nq.add_argument("--k", default="10", help="passages per prompt, comma list (e.g. 5,10,20)")
    nq.add_argument("--questions", type=int, default=100, help="questions of the split to run")
    nq.add_argument(
        "--split",
        choices=["eval", "calibration", "all"],
        default="eval",
        help="eval: the file's first 500 questions (reported figures); calibration: "
        "those from 1000 on (choosing settings); all: the whole file",
    )
    nq.add_argument("--offset", type=int, default=0, help="first question to use, in the split")
    _nq_run_options(nq)
    _nq_prompt_options(nq)
    nq.set_defaults(func=cmd_nq, gold_at="places")


def _nq_run_options(nq: argparse.ArgumentParser) -> None:
    """Add what an ``nq`` run keeps for later runs and reruns: baselines, documents, timing."""
    nq.add_argument(
        "--baselines",
        default=None,
        help="folder keeping full prefill's answers and logits for later runs "
        "(default: kvblend's cache folder, baselines/)",
    )
    nq.add_argument("--no-baselines", action="store_true", help="compute full prefill every time")
    nq.add_argument(
        "--store-dir",
        default=None,
        help="keep the documents' KV in this folder, so a later run reads them "
        "instead of precomputing them (default: in memory, per run)",
    )
    nq.add_argument(
        "--time-every",
        type=int,
        default=10,
        help="time full prefill again on every N-th question for the TTFT shares "
        "(0: only where it is computed)",
    )
    nq.add_argument(
        "--kl-only",
        action="store_true",
        help="prefill only: KL and first-token agreement, no answers (fast)",
    )
    nq.add_argument(
        "--fresh", action="store_true", help="start over instead of continuing the rows in --output"
    )


def _nq_prompt_options(nq: argparse.ArgumentParser) -> None:
    """Add how ``nq`` lays out its prompts and where its results and prompts go."""
    nq.add_argument(
        "--doc-prefix",
        choices=sorted(HEAD_CHOICES),
        default="auto",
        help="documents precomputed behind: the engine's defaults, not told "
        "the prompts' head (auto), their head (head), both, or BOS",
    )
    nq.add_argument(
        "--labels",
        choices=["computed", "cached"],
        default="computed",
        help="each passage's title label computed with its number (the paper's "
        "layout), or cached with the passage text (only `Document [i](` "
        "computed); the prompt text is the same",
    )
    nq.add_argument("--output", default=str(RESULTS_DIR / "nq.json"))
    nq.add_argument(
        "--shard",
        default="0/1",
        metavar="K/N",
        help="run every N-th question from the K-th (0 <= K < N) into "
        "OUTPUT.shard-K-of-N.json, one process per core; a run without --shard "
        "then takes the shards' rows and writes OUTPUT",
    )
    nq.add_argument(
        "--write-prompts",
        metavar="FILE",
        help="write the prompts to a JSONL file and run no strategy (the input of "
        "`kvblend bench vllm --nq FILE`)",
    )


def _add_shapes(sub: Subcommands) -> None:
    """Add ``shapes``: every prompt shape in one report."""
    shapes = sub.add_parser("shapes", help="every prompt shape in one report, head told or not")
    _model_options(shapes, dtype="float32")
    _retrieval_options(shapes, required=False)
    shapes.add_argument(
        "--shapes", default="all", help="comma list: nq-5, nq-10, nq-20, qa, records, long, all"
    )
    shapes.add_argument("--questions", type=int, default=40, help="questions per shape")
    shapes.add_argument("--heads", choices=sorted(HEAD_CHOICES), default="both")
    shapes.add_argument("--output", default=str(RESULTS_DIR / "shapes.json"))
    shapes.set_defaults(func=cmd_shapes)


def _add_registry(sub: Subcommands) -> None:
    """Add ``registry``: the cost of finding documents in a prompt."""
    registry = sub.add_parser(
        "registry", help="document-finding cost with 100 vs 100,000 known documents"
    )
    registry.add_argument("--counts", default="100,100000", help="registry sizes, comma list")
    registry.add_argument("--docs-in-prompt", type=int, default=10)
    registry.add_argument("--repeats", type=int, default=20)
    registry.add_argument("--output", default=str(RESULTS_DIR / "registry.json"))
    registry.set_defaults(func=cmd_registry)


def _add_report(sub: Subcommands) -> None:
    """Add ``report``: Markdown tables and PNG plots from saved results."""
    report = sub.add_parser("report", help="markdown tables and PNG plots from saved results")
    report.add_argument("--ttft", default=str(RECORDED_DIR / "ttft.json"))
    report.add_argument("--quality", default=str(RECORDED_DIR / "quality.json"))
    report.add_argument("--img-dir", default="docs/img")
    report.add_argument(
        "--closeness",
        default="",
        metavar="FILE[,FILE]",
        help="`kvblend bench nq` results: draw IMG_DIR/closeness.png (mean KL "
        "against compute, the bfloat16 floor a line)",
    )
    report.set_defaults(func=cmd_report)


def _add_doc_context(sub: Subcommands) -> None:
    """Add ``doc-context``: documents precomputed behind other contexts."""
    doc_context = sub.add_parser(
        "doc-context", help="blend settings with documents precomputed behind other contexts"
    )
    _model_options(doc_context, dtype="float32")
    doc_context.add_argument("--questions", type=int, default=80)
    doc_context.add_argument("--contexts", default="bos,prefix,sys", help="comma list")
    doc_context.add_argument(
        "--configs", default="reuse,cb15,cb15L2,cb30,epic16", help="comma list of CONFIGS names"
    )
    doc_context.add_argument("--output", default=str(RESULTS_DIR / "doc_context.json"))
    doc_context.set_defaults(func=cmd_doc_context)


def _add_redis_ttft(sub: Subcommands) -> None:
    """Add ``redis-ttft``: TTFT with documents from Redis; its throughput."""
    redis = sub.add_parser("redis-ttft", help="TTFT with documents from Redis; Redis throughput")
    _model_options(redis)
    redis.add_argument("--length", type=int, default=4096, help="prompt tokens")
    redis.add_argument("--doc-tokens", type=int, default=512)
    redis.add_argument("--repeats", type=int, default=5)
    redis.add_argument("--rounds", type=int, default=2, help="throughput: reads per entry")
    redis.add_argument("--redis-url", help="a running server (default: start redis-server)")
    redis.add_argument("--output", default=str(RESULTS_DIR / "redis_ttft.json"))
    redis.set_defaults(func=cmd_redis_ttft)


def _add_vllm(sub: Subcommands) -> None:
    """Add ``vllm``: vLLM with kvblend's connector against vanilla vLLM."""
    vllm = sub.add_parser(
        "vllm", help="vLLM + kvblend vs vanilla vLLM: TTFT and requests/s (run in vLLM's venv)"
    )
    vllm.add_argument("--model", help="model folder or GGUF file (default: the bundled model)")
    vllm.add_argument(
        "--lengths", default="512,1024,2048,4096,7680", help="prompt tokens, comma list"
    )
    vllm.add_argument("--repeats", type=int, default=2)
    vllm.add_argument("--doc-tokens", type=int, default=512)
    vllm.add_argument("--rate-length", type=int, default=2048, help="prompt tokens of req/s runs")
    vllm.add_argument("--rate-tokens", type=int, default=16, help="tokens each request generates")
    vllm.add_argument("--work-dir", help="folder for the store, jobs and vLLM logs (default: tmp)")
    vllm.add_argument(
        "--busy-core",
        action="store_true",
        help="a second process keeps one core busy during the run",
    )
    vllm.add_argument(
        "--stall-repeats", type=int, default=2, help="rounds of the stall test (0: none)"
    )
    vllm.add_argument("--no-rate", action="store_true", help="skip the requests/s runs")
    vllm.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="what both servers serve in (documents precomputed in it)",
    )
    vllm.add_argument(
        "--nq",
        metavar="PROMPTS",
        help="instead of timing: accuracy on the prompts of `kvblend bench "
        "nq --write-prompts PROMPTS`, vLLM vs the engine",
    )
    vllm.add_argument("--questions", type=int, default=0, help="--nq: the first N (0: all)")
    vllm.add_argument("--max-new-tokens", type=int, default=32, help="--nq: answer tokens")
    vllm.add_argument("--seed", type=int, default=0, help="--nq: seed of the bootstrap")
    vllm.add_argument(
        "--output", default=None, help=f"default: {RESULTS_DIR}/vllm.json (--nq: vllm_nq.json)"
    )
    vllm.set_defaults(func=cmd_vllm)


def _add_scripts(sub: Subcommands) -> None:
    """Add The `SCRIPTS`, each handed its own options by `main`."""
    for name, (_, what) in SCRIPTS.items():  # listed here; `main` hands them their options
        script = sub.add_parser(
            name, help=f"{what} (options: kvblend bench {name} --help)", add_help=False
        )
        script.add_argument("args", nargs=argparse.REMAINDER)
        script.set_defaults(func=lambda args, name=name: run_script(name, args.args))


#: The subcommands, in the order ``kvblend bench --help`` lists them.
SUBCOMMANDS: tuple[Callable[[Subcommands], None], ...] = (
    _add_ttft,
    _add_figures,
    _add_quality,
    _add_ingest,
    _add_gpu,
    _add_plan,
    _add_ops,
    _add_headline,
    _add_nq,
    _add_shapes,
    _add_registry,
    _add_report,
    _add_doc_context,
    _add_redis_ttft,
    _add_vllm,
    _add_scripts,
)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvblend bench``."""
    if argv and argv[0] in SCRIPTS:  # their own parsers read every option
        return run_script(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "quick", False):
        args.lengths, args.strategies, args.repeats = (
            "1024,2048",
            "prefix,cacheblend-value-0.15,reuse",
            3,
        )
    if getattr(args, "disk_strategies", None) == "":
        args.disk_strategies = None
    args.func(args)
    return 0
