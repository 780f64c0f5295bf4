"""One prompt's run for the adapters: blended prefill and decoding, summarised as a `BlendRun`.

- `run_prompt`: one prompt, decoded in full; `run_prompts`: several prompts, their prefills then
  one batched decode; `stream_prompt`: text pieces as decoded, then the summary;
- `BlendRun`: text, token counts, the prefill's `BlendStats` and time to the first token, whose
  `BlendRun.kvblend_metadata` is the stats dict both adapters report;
- `CANCEL_EVENT`: the cancel event of the request running in this context (set by the async
  glue in `kvblend.integrations.background`), handed to the engine so that a cancelled caller
  stops the work within one layer or token;
- `last_run_seconds`: how long a prompt last took on an engine, which sets how long the async
  glue gathers concurrent calls.

Part of the adapters' shared layer (`kvblend.integrations.shared` re-exports the names); imports no
framework.
"""

from __future__ import annotations

import contextvars
import dataclasses
import threading
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvblend.blend.config import BlendConfig
from kvblend.engine.engine import BlendEngine
from kvblend.engine.results import BlendStats
from kvblend.prompt.segments import Segment

__all__ = [
    "CANCEL_EVENT",
    "BlendRun",
    "last_run_seconds",
    "run_prompt",
    "run_prompts",
    "stream_prompt",
]


@dataclass
class BlendRun:
    """The outcome of one prompt: text, counts and what the prefill reused."""

    text: str
    output_tokens: int
    stats: BlendStats
    ttft_s: float
    finish_reason: str
    batch_size: int = 1

    def kvblend_metadata(self) -> dict[str, Any]:
        """Describe what the prefill did (reported as ``kvblend`` metadata by the adapters).

        Every field of the prefill's `BlendStats` but its timings (so a field the engine adds,
        such as why a prompt fell back to a full prefill, reaches the metadata as is); the time
        to the first token ``ttft_s`` (in a batch, the batch's: its first tokens come once every
        prompt is prefilled); ``prefill_s``, this prompt's own prefill; and ``batch_size``, the
        prompts decoded together (1: alone).
        """
        stats = self.stats
        if dataclasses.is_dataclass(stats):
            names = [f.name for f in dataclasses.fields(stats) if f.name != "timings"]
        else:  # a stats object of another kind: the fields every version has
            names = [*_STATS_FIELDS]
        timings = getattr(stats, "timings", None) or {}
        return {
            **{name: getattr(stats, name, None) for name in names},
            "ttft_s": self.ttft_s,
            "prefill_s": timings.get("prefill_s"),
            "batch_size": self.batch_size,
        }


#: The `BlendStats` fields the metadata always holds.
_STATS_FIELDS = (
    "strategy",
    "prompt_tokens",
    "reused_tokens",
    "prefix_tokens",
    "recomputed_tokens",
    "computed_tokens",
    "segments_cached",
    "segments_precomputed",
    "documents_found",
    "documents_reused",
)

#: The cancel event of the request running in this thread (`run_in_thread`,
#: `iterate_in_thread`): `run_prompt` and `stream_prompt` hand it to the engine.
CANCEL_EVENT: contextvars.ContextVar[threading.Event | None] = contextvars.ContextVar(
    "kvblend_cancel", default=None
)


def _cancel_option() -> dict[str, Any]:
    """``{"cancel": event}`` inside `run_in_thread` / `iterate_in_thread`, else nothing."""
    cancel = CANCEL_EVENT.get()
    return {} if cancel is None else {"cancel": cancel}


#: Seconds one prompt last took on each engine: how long gathering concurrent calls may wait.
_RUN_SECONDS: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def _note_run_time(engine: Any, seconds: float) -> None:
    try:
        _RUN_SECONDS[engine] = float(seconds)
    except TypeError:  # an engine that cannot be weakly referenced: the default wait
        pass


def last_run_seconds(engine: Any, default: float = 0.03) -> float:
    """Seconds one prompt last took on ``engine`` (``default`` before its first run)."""
    try:
        return _RUN_SECONDS.get(engine, default)
    except TypeError:  # an engine that cannot be weakly referenced
        return default


def run_prompt(
    engine: BlendEngine,
    segments: list[Segment],
    config: BlendConfig | None,
    options: dict[str, Any],
) -> BlendRun:
    """Blended prefill and full decoding; ``options`` are `BlendEngine.generate` keywords.

    Run by `run_in_thread`, it stops within one layer (or token) once its caller is cancelled.
    """
    result = engine.generate(segments, config, **options, **_cancel_option())
    _note_run_time(engine, result.total_s)
    return BlendRun(
        result.text, len(result.token_ids), result.stats, result.ttft_s, result.finish_reason
    )


def run_prompts(
    engine: BlendEngine,
    prompts: list[list[Segment]],
    config: BlendConfig | None,
    options: dict[str, Any],
) -> list[BlendRun]:
    """`run_prompt` for several prompts: their prefills, then one batched decode.

    Uses `BlendEngine.generate_batch` when the engine has it (else one prompt at a time).
    """
    generate_batch = getattr(engine, "generate_batch", None)
    if len(prompts) < 2 or generate_batch is None:
        return [run_prompt(engine, segments, config, options) for segments in prompts]
    results = generate_batch(prompts, config, **options)
    _note_run_time(engine, max(r.total_s for r in results) / len(results))
    return [
        BlendRun(
            r.text,
            len(r.token_ids),
            r.stats,
            r.ttft_s,
            r.finish_reason,
            getattr(r, "batch_size", 1),
        )
        for r in results
    ]


def stream_prompt(
    engine: BlendEngine,
    segments: list[Segment],
    config: BlendConfig | None,
    options: dict[str, Any],
) -> Iterator[str | BlendRun]:
    """Blended prefill, then text pieces as decoded, then a final `BlendRun` summary.

    ``options`` are `BlendEngine.stream` keywords and must include ``max_new_tokens``.
    """
    started = time.perf_counter()
    prefill = engine.prefill(segments, config, **_cancel_option())
    ttft: float | None = None
    pieces: list[str] = []
    for piece in engine.stream(prefill, **options):  # stops when the consumer leaves
        if ttft is None:
            ttft = time.perf_counter() - started
        pieces.append(piece)
        yield piece
    text = "".join(pieces)
    output_tokens = len(engine.tokenize(text)) if text else 0
    stopped = output_tokens < options["max_new_tokens"]
    yield BlendRun(
        text,
        output_tokens,
        prefill.stats,
        ttft if ttft is not None else time.perf_counter() - started,
        "stop" if stopped else "length",
    )
