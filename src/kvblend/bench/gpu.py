"""The GPU benchmark: one run gives every figure the GPU path is judged by.

TTFT of ``full``, the default, ``cacheblend-value-0.15`` and ``reuse`` at 4K, 8K, 16K and 32K
prompt tokens, with the documents in memory and read from a cold disk tier (`run_ttft`, runs
interleaved), decode tokens/s after a full prefill and after the default, peak GPU memory of
every timed prefill (``torch.cuda.max_memory_allocated``, from `PeakMemory`) and of the whole
run, and documents/s of precompute, one by one vs batched (`run_ingest`). Nothing here is
specific to a GPU model: it runs unchanged on any CUDA machine, and on the CPU
(``--device cpu --lengths 1024 --dtype float32``) as a smoke test of the same code path.

The baselines are transformers' own: its forward over the same prompt's token ids
(``model(input_ids, logits_to_keep=1)``, SDPA attention) and ``generate`` up to the first token
(`run_transformers`). ``--model-shape llama-1b`` / ``llama-8b`` replaces the model by one of
that shape with random weights (`kvblend.bench.random_models`): timing needs no trained weights.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from ..engine import BlendEngine
from .ingest import ingest_table, run_ingest
from .random_models import MODEL_SHAPES
from .strategies import parse_strategies
from .ttft import QUESTION, SYSTEM, build_documents, run_ttft, ttft_table

DEFAULT_LENGTHS = "4096,8192,16384,32000"
DEFAULT_STRATEGIES = "full,default,cacheblend-value-0.15,reuse"


def add_gpu_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``kvblend bench gpu`` (the model options are added by the caller)."""
    parser.set_defaults(device="cuda", dtype="bf16")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help="prompt tokens, comma list")
    parser.add_argument("--strategies", default=DEFAULT_STRATEGIES, help="comma list")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=32, help="0 to skip decode speed")
    parser.add_argument("--no-disk", action="store_true", help="skip the cold-disk runs")
    parser.add_argument("--ingest-documents", type=int, default=None,
                        help="documents of the precompute timing (default 64 on a GPU, 4 on "
                             "the CPU; 0 to skip it)")  # fmt: skip
    parser.add_argument("--batch-tokens", default="4096,16384",
                        help="token budgets of the batched precompute runs")  # fmt: skip
    parser.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        default=None,
        help="time a model of this shape with random weights instead of --model "
        "(whose tokenizer is still used)",
    )
    parser.add_argument("--tokenizer", default=None,
                        help="with --model-shape: a folder of tokenizer files to use instead of "
                             "loading --model (no weights needed)")  # fmt: skip
    parser.add_argument("--output", default="benchmarks/results/gpu.json")


def shaped_engine(args: argparse.Namespace) -> BlendEngine:
    """Build an engine over a random-weight ``--model-shape`` model and ``--model``'s tokenizer.

    With ``--tokenizer FOLDER`` the tokenizer is read from that folder alone (no model loaded).
    """
    from ..cli_args import check_device
    from ..engine.loading import resolve_device, resolve_dtype
    from ..store import MemoryKVStore
    from .random_models import random_model

    check_device(args.device)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tokenizer = shape_tokenizer(args.model, args.tokenizer)
    model = random_model(args.model_shape, tokenizer, device, dtype)
    return BlendEngine(
        model, tokenizer, store=MemoryKVStore(8 << 30), system_prompt=SYSTEM,
        name=f"{args.model_shape} (random weights)",
    )  # fmt: skip


def shape_tokenizer(model: str | None, folder: str | None) -> Any:
    """Return the tokenizer of a random-weight run: ``folder``'s files, else ``model``'s."""
    from ..engine.loading import load_model, resolve_model

    if folder is None:
        return load_model(resolve_model(model), torch.device("cpu"), torch.float32)[1]
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        reason = " ".join(str(error).split())
        raise ValueError(f"--tokenizer {folder}: not a tokenizer folder ({reason})") from None


def parse_lengths(text: str) -> list[int]:
    """Prompt lengths from a comma list; each a positive integer."""
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--lengths must be a comma list of integers, got {text!r}") from None
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths must list positive token counts, got {text!r}")
    return lengths


def run_gpu(engine: BlendEngine, args: argparse.Namespace) -> dict[str, Any]:
    """Run the TTFT and ingestion parts on ``engine``'s device; return both and peak memory."""
    device = engine.decoder.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    ttft = run_ttft(
        engine, lengths=parse_lengths(args.lengths), strategies=parse_strategies(args.strategies),
        repeats=args.repeats, doc_tokens=args.doc_tokens, disk=not args.no_disk,
        disk_strategies=None, decode_tokens=args.decode_tokens, seed=args.seed,
    )  # fmt: skip
    documents = args.ingest_documents
    if documents is None:
        documents = 64 if device.type == "cuda" else 4
    ingest = None
    if documents > 0:
        ingest = run_ingest(
            engine, documents=documents, doc_tokens=args.doc_tokens,
            batch_tokens=parse_lengths(args.batch_tokens), repeats=args.repeats,
            seed=args.seed,
        )  # fmt: skip
    baseline = run_transformers(
        engine, parse_lengths(args.lengths), args.repeats, args.doc_tokens, args.seed,
        decode_tokens=args.decode_tokens,
    )  # fmt: skip
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
    return {
        "benchmark": "gpu",
        "model_shape": args.model_shape,
        "elapsed_s": time.perf_counter() - started,
        "peak_gpu_mib": peak,
        "ttft": ttft,
        "transformers": baseline,
        "ingest": ingest,
    }


def _timed(device: torch.device, run: Any) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def run_transformers(
    engine: BlendEngine,
    lengths: list[int],
    repeats: int,
    doc_tokens: int,
    seed: int,
    decode_tokens: int = 0,
) -> list[dict[str, Any]]:
    """Time transformers' forward and ``generate`` to the first token on the TTFT prompts.

    The same prompts as `run_ttft` (same documents and template), as token ids; the forward
    keeps only the last position's logits and reads the first token, as ``generate`` does.
    With ``decode_tokens`` > 1, ``generate`` also runs to exactly that many tokens: its decode
    speed is the tokens after the first over the time from the first token to the last, both
    timed in that same run (`_FirstTokenClock`), so it is positive whatever else the machine
    does (a difference of two runs was not: on a busy CPU the 1-token run could take longer).
    """
    model: Any = engine.model
    device = engine.decoder.device
    prompts = {}
    for length in lengths:
        documents = build_documents(engine, length, doc_tokens, seed + length)
        plan = engine.plan(engine.rag_segments(QUESTION, documents, system=SYSTEM))
        prompts[length] = torch.tensor([plan.token_ids], device=device)

    def forward(ids: torch.Tensor) -> None:
        logits = model(ids, logits_to_keep=1).logits
        int(logits[0, -1].argmax())

    clock = _FirstTokenClock(device)

    def generate(ids: torch.Tensor, tokens: int = 1) -> None:
        model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
            min_new_tokens=tokens, do_sample=False, pad_token_id=engine.tokenizer.eos_token_id,
            stopping_criteria=StoppingCriteriaList([clock.start()]) if tokens > 1 else None,
        )  # fmt: skip

    runs = {"transformers-forward": forward, "transformers-generate": generate}
    if decode_tokens > 1:
        runs["transformers-decode"] = lambda ids: generate(ids, decode_tokens)
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for ids in list(prompts.values())[:1]:  # warm-up
            forward(ids)
            generate(ids)
        for _ in range(repeats):
            for length, ids in prompts.items():
                for name, run in runs.items():
                    elapsed = _timed(device, lambda run=run, ids=ids: run(ids))
                    times.setdefault((length, name), []).append(elapsed)
                    if name == "transformers-decode":  # the same run's time after its first token
                        times.setdefault((length, "decode-after-first"), []).append(
                            clock.after_first()
                        )
    rows = [
        {
            "target_tokens": length,
            "prompt_tokens": prompts[length].shape[1],
            "run": name,
            "ttft_median_s": statistics.median(values),
            "ttft_min_s": min(values),
        }  # fmt: skip
        for (length, name), values in times.items()
        if name in runs and name != "transformers-decode"
    ]
    return rows + _decode_rows(times, prompts, decode_tokens)


class _FirstTokenClock(StoppingCriteria):
    """Times one ``generate`` call from its first new token to its end.

    ``generate`` calls its stopping criteria once after each new token: the first call marks
    the first token (after a device sync, so the prefill is done), `after_first` the end.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.first_at: float | None = None

    def start(self) -> _FirstTokenClock:
        self.first_at = None
        return self

    def __call__(
        self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any
    ) -> torch.Tensor:
        if self.first_at is None:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.first_at = time.perf_counter()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def after_first(self) -> float:
        """Seconds from the first new token to now (the run's end, once it is synced)."""
        assert self.first_at is not None, "generate made no token"
        return time.perf_counter() - self.first_at


def _decode_rows(
    times: dict[tuple[int, str], list[float]], prompts: dict[int, torch.Tensor], tokens: int
) -> list[dict[str, Any]]:
    """Return ``generate``'s decode tokens/s per length (after the first token, in one run)."""
    rows = []
    for length, ids in prompts.items():
        whole = times.get((length, "transformers-decode"))
        if not whole:
            continue
        after_first = times[(length, "decode-after-first")]
        rates = [(tokens - 1) / seconds for seconds in after_first if seconds > 0]
        rows.append({
            "target_tokens": length, "prompt_tokens": ids.shape[1], "run": "transformers-decode",
            "decode_tokens": tokens, "total_median_s": statistics.median(whole),
            "decode_tok_s_median": statistics.median(rates) if rates else None,
        })  # fmt: skip
    return rows


def baseline_table(result: dict[str, Any]) -> str:
    """Markdown: transformers' forward and generate vs kvblend's strategies, per length."""
    summary = result["ttft"]["summary"]
    lines = [
        "| prompt | transformers forward | transformers generate | kvblend full / forward "
        "| default / forward | reuse / forward | decode tok/s: generate, after default |",
        "|---|---|---|---|---|---|---|",
    ]
    baseline = {(row["target_tokens"], row["run"]): row for row in result["transformers"]}
    for length in sorted({row["target_tokens"] for row in result["transformers"]}):
        forward = baseline[(length, "transformers-forward")]["ttft_median_s"]
        generate = baseline[(length, "transformers-generate")]["ttft_median_s"]
        memory = [s for s in summary if s["store"] == "memory" and s["target_tokens"] == length]
        ours = {s["strategy"]: s["ttft_median_s"] for s in memory}
        ratios = [
            f"{ours[name] / forward:.2f}" if name in ours else "n/a"
            for name in ("full", "default", "reuse")
        ]
        after = [s.get("decode_tok_s_median") for s in memory if s["strategy"] == "default"]
        rates = [
            baseline.get((length, "transformers-decode"), {}).get("decode_tok_s_median"),
            after[0] if after else None,
        ]
        decode = ", ".join(f"{rate:.1f}" if rate else "n/a" for rate in rates)
        lines.append(
            f"| {baseline[(length, 'transformers-forward')]['prompt_tokens']} | "
            f"{forward:.3f} s | {generate:.3f} s | {' | '.join(ratios)} | {decode} |"
        )
    return "\n".join(lines)


def gpu_table(result: dict[str, Any]) -> str:
    """Markdown of a GPU run: the TTFT table, then ingestion."""
    peak = result["peak_gpu_mib"]
    parts = [
        "Peak GPU memory of the whole run: "
        + (f"{peak:.0f} MiB" if peak is not None else "n/a (not a CUDA device)"),
        "",
        ttft_table(result["ttft"]["summary"]),
        "",
        baseline_table(result),
    ]
    if result["ingest"] is not None:
        parts += ["", ingest_table(result["ingest"])]
    return "\n".join(parts)
