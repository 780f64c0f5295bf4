"""The GPU benchmark: one run gives every figure the GPU path is judged by.

TTFT of ``full``, the default, ``cacheblend-value-0.15`` and ``reuse`` at 4K, 8K, 16K and 32K
prompt tokens, each prompt given as its string as users give it (finding its documents and its
tokens timed), with the documents in the model device's memory, in host memory (pinned on CUDA)
and read from a cold disk tier (`run_ttft`, runs interleaved; each row also gives the TTFT
without the prompt handling: from ids), decode tokens/s after a full prefill and after the
default, peak GPU memory of every timed prefill (``torch.cuda.max_memory_allocated``, from
`PeakMemory`) and of the whole run, and documents/s of precompute, one by one vs batched
(`run_ingest`). Nothing here is specific to a GPU model: it runs unchanged on any CUDA machine,
and on the CPU (``--device cpu --lengths 1024 --dtype float32``) as a smoke test of the same
code path.

The baselines are transformers' own, as users call them: its forward over the same prompt
(``model(input_ids, logits_to_keep=1)``, SDPA attention) and ``generate`` up to the first token,
each from the prompt string (``tokenizer(prompt)`` timed) and from its token ids
(`run_transformers`). ``--model-shape llama-1b`` / ``llama-8b`` replaces the model by one of
that shape with random weights (`kvblend.bench.gpu.random_models`): timing needs no trained weights.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from kvblend.bench.gpu.random_models import MODEL_SHAPES
from kvblend.bench.result_files import RESULTS_DIR
from kvblend.bench.speed.ingest import ingest_table, run_ingest
from kvblend.bench.speed.ttft import QUESTION, SYSTEM, build_documents, run_ttft
from kvblend.bench.speed.ttft_summary import ttft_table
from kvblend.bench.strategies import parse_strategies
from kvblend.engine.engine import BlendEngine

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
    parser.add_argument(
        "--no-host", action="store_true", help="skip the runs with the documents in host memory"
    )
    parser.add_argument(
        "--ingest-documents",
        type=int,
        default=None,
        help="documents of the precompute timing (default 64 on a GPU, 4 on the CPU; 0 to skip it)",
    )
    parser.add_argument(
        "--batch-tokens", default="4096,16384", help="token budgets of the batched precompute runs"
    )
    parser.add_argument(
        "--model-shape",
        choices=sorted(MODEL_SHAPES),
        default=None,
        help="time a model of this shape with random weights instead of --model "
        "(whose tokenizer is still used)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="with --model-shape: a folder of tokenizer files to use instead of "
        "loading --model (no weights needed)",
    )
    parser.add_argument("--output", default=str(RESULTS_DIR / "gpu.json"))


def shaped_engine(args: argparse.Namespace) -> BlendEngine:
    """Build an engine over a random-weight ``--model-shape`` model and ``--model``'s tokenizer.

    With ``--tokenizer FOLDER`` the tokenizer is read from that folder alone (no model loaded).
    """
    from kvblend.bench.gpu.random_models import random_model
    from kvblend.command_line import check_device
    from kvblend.models.loading import resolve_device, resolve_dtype
    from kvblend.store import MemoryKVStore

    check_device(args.device)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    tokenizer = shape_tokenizer(args.model, args.tokenizer)
    model = random_model(args.model_shape, tokenizer, device, dtype)
    return BlendEngine(
        model,
        tokenizer,
        store=MemoryKVStore(8 << 30),
        system_prompt=SYSTEM,
        name=f"{args.model_shape} (random weights)",
    )


def shape_tokenizer(model: str | None, folder: str | None) -> Any:
    """Return the tokenizer of a random-weight run: ``folder``'s files, else ``model``'s."""
    from kvblend.models.loading import load_model, resolve_model

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
        engine,
        lengths=parse_lengths(args.lengths),
        strategies=parse_strategies(args.strategies),
        repeats=args.repeats,
        doc_tokens=args.doc_tokens,
        disk=not args.no_disk,
        disk_strategies=None,
        decode_tokens=args.decode_tokens,
        seed=args.seed,
        host=not args.no_host,
        from_text=True,
    )
    documents = args.ingest_documents
    if documents is None:
        documents = 64 if device.type == "cuda" else 4
    ingest = None
    if documents > 0:
        ingest = run_ingest(
            engine,
            documents=documents,
            doc_tokens=args.doc_tokens,
            batch_tokens=parse_lengths(args.batch_tokens),
            repeats=args.repeats,
            seed=args.seed,
        )
    baseline = run_transformers(
        engine,
        parse_lengths(args.lengths),
        args.repeats,
        args.doc_tokens,
        args.seed,
        decode_tokens=args.decode_tokens,
    )
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


def _prompts(
    engine: BlendEngine, lengths: list[int], doc_tokens: int, seed: int
) -> dict[int, tuple[str, bool, torch.Tensor]]:
    """Return the TTFT prompts per length: the string, whether specials are added, the ids.

    The ids are the engine's for the string (a chat template's BOS not doubled), which
    ``tokenizer(prompt)`` gives too: checked here.
    """
    prompts = {}
    for length in lengths:
        documents = build_documents(engine, length, doc_tokens, seed + length)
        segments = engine.rag_segments(QUESTION, documents, system=SYSTEM)
        text = "".join(segment.text for segment in segments)
        ids = torch.from_numpy(engine.plan(segments).token_ids)[None]
        bos = engine.tokenizer.bos_token
        specials = not (bos and text.startswith(bos))
        if engine.tokenizer(text, add_special_tokens=specials)["input_ids"] != ids[0].tolist():
            raise RuntimeError("the engine's prompt ids are not the tokenizer's: a bug")
        prompts[length] = (text, specials, ids)
    return prompts


def run_transformers(
    engine: BlendEngine,
    lengths: list[int],
    repeats: int,
    doc_tokens: int,
    seed: int,
    decode_tokens: int = 0,
) -> list[dict[str, Any]]:
    """Time transformers' forward and ``generate`` to the first token on the TTFT prompts.

    The same prompts as `run_ttft` (same documents and template), from the string
    (``-text`` runs: ``tokenizer(prompt, return_tensors="pt")`` and the copy to the device are
    timed) and from token ids already on the device; the forward keeps only the last position's
    logits and reads the first token, as ``generate`` does. With ``decode_tokens`` > 1,
    ``generate`` also runs to exactly that many tokens: its decode speed is the tokens after the
    first over the time from the first token to the last, both timed in that same run
    (`_FirstTokenClock`), so it is positive whatever else the machine does (a difference of two
    runs was not: on a busy CPU the 1-token run could take longer).
    """
    prompts = _prompts(engine, lengths, doc_tokens, seed)
    calls = _TransformersCalls(engine, prompts)
    runs = calls.runs(decode_tokens)
    device = calls.device
    times: dict[tuple[int, str], list[float]] = {}
    with torch.inference_mode():
        for length in lengths[:1]:  # warm-up
            runs["transformers-forward-text"](length)
            runs["transformers-generate-text"](length)
        for _ in range(repeats):
            for length in prompts:
                for name, run in runs.items():
                    elapsed = _timed(device, lambda run=run, length=length: run(length))
                    times.setdefault((length, name), []).append(elapsed)
                    if name == "transformers-decode":  # the same run's time after its first token
                        times.setdefault((length, "decode-after-first"), []).append(
                            calls.clock.after_first()
                        )
    rows = [
        {
            "target_tokens": length,
            "prompt_tokens": calls.device_ids[length].shape[1],
            "run": name,
            "ttft_median_s": statistics.median(values),
            "ttft_min_s": min(values),
        }
        for (length, name), values in times.items()
        if name in runs and name != "transformers-decode"
    ]
    return rows + _decode_rows(times, calls.device_ids, decode_tokens)


class _TransformersCalls:
    """transformers' own calls on the TTFT prompts: its forward and ``generate``.

    Each from the prompt string (tokenized and copied to the device in the timed call) or from
    its token ids already on the device.
    """

    def __init__(
        self, engine: BlendEngine, prompts: dict[int, tuple[str, bool, torch.Tensor]]
    ) -> None:
        self.engine, self.prompts = engine, prompts
        self.model: Any = engine.model
        self.device = engine.decoder.device
        self.device_ids = {length: ids.to(self.device) for length, (_, _, ids) in prompts.items()}
        self.clock = _FirstTokenClock(self.device)

    def encode(self, length: int) -> torch.Tensor:
        """Tokenize the prompt of ``length`` and copy its ids to the device."""
        text, specials, _ = self.prompts[length]
        ids = self.engine.tokenizer(text, add_special_tokens=specials, return_tensors="pt")
        return ids["input_ids"].to(self.device)

    def forward(self, ids: torch.Tensor) -> None:
        """Run the model's forward, the last position's logits only, and read the first token."""
        logits = self.model(ids, logits_to_keep=1).logits
        int(logits[0, -1].argmax())

    def generate(self, ids: torch.Tensor, tokens: int = 1) -> None:
        """Run ``generate`` to exactly ``tokens`` tokens (the clock times those after the first)."""
        self.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=self.engine.tokenizer.eos_token_id,
            stopping_criteria=StoppingCriteriaList([self.clock.start()]) if tokens > 1 else None,
        )

    def runs(self, decode_tokens: int) -> dict[str, Callable[[int], None]]:
        """Return the timed runs by name, each taking a prompt length."""
        runs: dict[str, Callable[[int], None]] = {
            "transformers-forward": lambda n: self.forward(self.device_ids[n]),
            "transformers-forward-text": lambda n: self.forward(self.encode(n)),
            "transformers-generate": lambda n: self.generate(self.device_ids[n]),
            "transformers-generate-text": lambda n: self.generate(self.encode(n)),
        }
        if decode_tokens > 1:
            runs["transformers-decode"] = lambda n: self.generate(self.device_ids[n], decode_tokens)
        return runs


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
        rows.append(
            {
                "target_tokens": length,
                "prompt_tokens": ids.shape[1],
                "run": "transformers-decode",
                "decode_tokens": tokens,
                "total_median_s": statistics.median(whole),
                "decode_tok_s_median": statistics.median(rates) if rates else None,
            }
        )
    return rows


def baseline_table(result: dict[str, Any]) -> str:
    """Markdown: transformers' forward and generate vs kvblend's strategies, per length.

    Every ratio is over transformers' forward from the prompt string; "from ids" leaves the
    prompt handling out of both sides.
    """
    summary = result["ttft"]["summary"]
    lines = [
        "| prompt | transformers forward: text, ids | generate: text, ids | kvblend full / "
        "forward | default / forward | reuse / forward | from ids: full, default, reuse | "
        "decode tok/s: generate, after default |",
        "|---|---|---|---|---|---|---|---|",
    ]
    baseline = {(row["target_tokens"], row["run"]): row for row in result["transformers"]}

    def median(length: int, run: str) -> float | None:
        row = baseline.get((length, run))
        return row["ttft_median_s"] if row else None

    for length in sorted({row["target_tokens"] for row in result["transformers"]}):
        forward, forward_ids = (median(length, "transformers-forward" + k) for k in ("-text", ""))
        generate, generate_ids = (
            median(length, "transformers-generate" + k) for k in ("-text", "")
        )
        memory = {
            s["strategy"]: s
            for s in summary
            if s["store"] == "memory" and s["target_tokens"] == length
        }
        names = ("full", "default", "reuse")
        ratios = [_ratio(memory.get(name, {}).get("ttft_median_s"), forward) for name in names]
        from_ids = [
            _ratio(memory.get(n, {}).get("ttft_from_ids_median_s"), forward_ids) for n in names
        ]
        rates = [
            baseline.get((length, "transformers-decode"), {}).get("decode_tok_s_median"),
            memory.get("default", {}).get("decode_tok_s_median"),
        ]
        decode = ", ".join(f"{rate:.1f}" if rate else "n/a" for rate in rates)
        lines.append(
            f"| {baseline[(length, 'transformers-forward')]['prompt_tokens']} | "
            f"{_seconds(forward)}, {_seconds(forward_ids)} | "
            f"{_seconds(generate)}, {_seconds(generate_ids)} | {' | '.join(ratios)} | "
            f"{', '.join(from_ids)} | {decode} |"
        )
    return "\n".join(lines)


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "n/a"


def _seconds(value: float | None) -> str:
    return f"{value:.3f} s" if value is not None else "n/a"


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
