"""What the connector does with one request, decided from its prompt token ids (no model runs).

vLLM hands the scheduler side a request's token ids, not its text. `plan_request` decodes them,
checks that tokenizing the text as a whole gives exactly those ids (else nothing is reused: the
plan would not describe what the model reads), finds the registry's documents in the text and
plans the prefill with the engine's own `plan_prefill`: documents are matched on tokens, their
edge tokens that merge with a neighbour are computed. Then, unlike the engine, nothing missing
is computed into the store on the way: a span whose entry the store does not hold (or cannot
be asked about) and the rows vLLM's own prefix cache already holds are turned into computed
rows (`restrict`), and the engine's budget rule (`forecast_blend`) decides on what is left.

The result, a `RequestPlan`, says how many tokens the connector provides (all but the last
prompt token, from vLLM's prefix hit on) or, with ``why`` (a `RequestFallback`: its code and its
words), why vLLM prefills the prompt itself; and the rows a blend computes, from the strategy's
own forecast (`forecast_blend`'s ``computed_rows``, the same forecast ``explain`` and the
engine's stats report), which the admission policy (`admission`) turns into a forecast time.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvblend.blend.config import BlendConfig
from kvblend.blend.forecast import forecast_blend
from kvblend.prompt.plan import (
    PlannedSpan,
    PrefillPlan,
    SpanReport,
    TokenKind,
    cached_pieces,
    plan_prefill,
)
from kvblend.prompt.tokens import encode_prompt
from kvblend.vllm.costs import Forecast
from kvblend.vllm.fallbacks import NO_DOCUMENT, RequestFallback

logger = logging.getLogger(__name__)

__all__ = [
    "RequestPlan",
    "approximate_from",
    "plan_request",
    "restrict",
]


@dataclass
class RequestPlan:
    """The connector's decision for one request, made on the scheduler side.

    Rows ``[start, stop)`` are provided by the connector (``claimed``); ``start`` is vLLM's own
    prefix-cache hit, ``stop`` the last prompt token, which vLLM always computes.
    """

    plan: PrefillPlan
    config: BlendConfig
    start: int
    stop: int
    reused: int = (
        0  # prompt tokens nobody computes: vLLM's prefix hit plus rows read from the store
    )
    recomputed: int = 0  # rows read from the store that the strategy recomputes
    #: why vLLM prefills the prompt itself, its code and its words (None: the connector blends)
    why: RequestFallback | None = None
    #: found documents whose KV is not stored yet: (text, document context), filled after the blend
    missing: list[tuple[str, str]] = field(default_factory=list)
    #: rows the blend computes, summed over its passes, a pass through part of the layers
    #: counted by its share of them (the strategy's forecast): the cost model's input
    rows: int = 0
    #: the first row whose blended KV may differ from what a full prefill computes (a moved
    #: document's first row; ``total`` when every row is exact): blocks from there on are kept
    #: out of vLLM's prefix cache for requests computing in full
    approximate_from: int = 0
    #: documents found whose KV the store does not hold (their numbers in the prompt, from 1)
    not_stored: list[int] = field(default_factory=list)
    #: the blend's and vLLM's prefill's forecast times (None: not forecast)
    forecast: Forecast | None = None
    refused: bool = False  # a request option was refused (the reason is ``why``)
    unreachable: str | None = None  # why the store could not be asked (an outage), if so
    plan_s: float = 0.0  # the scheduler side's time deciding (planning, forecasting)

    @property
    def fallback(self) -> str | None:
        """Return why vLLM prefills the prompt itself, in words (None: the connector blends)."""
        return None if self.why is None else str(self.why)

    @property
    def claimed(self) -> int:
        """Return the tokens the connector provides (0 when vLLM prefills the prompt itself)."""
        return 0 if self.why is not None else max(0, self.stop - self.start)

    @property
    def total(self) -> int:
        """Return the prompt's token count."""
        return len(self.plan.token_ids)

    @property
    def computed(self) -> int:
        """Return the prompt tokens computed (by the blend or vLLM), recomputed ones included."""
        return self.total - self.reused

    def summary(self) -> dict[str, Any]:
        """Return the record a response carries (``kv_transfer_params["kvblend"]``)."""
        blended = self.why is None
        return {
            "strategy": self.config.strategy if blended else "vllm",
            "prompt_tokens": self.total,
            "cached_tokens": self.reused if blended else self.start,
            "recomputed_tokens": self.recomputed if blended else 0,
            "vllm_prefix_tokens": self.start,
            "fallback": self.fallback,
            "plan_s": round(self.plan_s, 4),
            **({"not_stored": list(self.not_stored)} if self.not_stored else {}),
        }


def _decoded(tokenizer: Any, token_ids: Sequence[int]) -> tuple[str, Any] | None:
    """Return the prompt's text and its whole-text tokens, if they are exactly ``token_ids``."""
    text = tokenizer.decode(
        list(token_ids), skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    tokens = encode_prompt(tokenizer, text)
    same = np.array_equal(tokens.ids, np.asarray(token_ids, dtype=np.int64))
    return (text, tokens) if same else None


def restrict(plan: PrefillPlan, start: int, dropped: set[int], why: str) -> PrefillPlan:
    """``plan`` with rows below ``start`` and the spans ``dropped`` (by index) computed instead.

    Spans that reach below ``start`` keep their rows from ``start`` on; the report names the
    dropped spans' documents with ``why`` and points the others at their new span indices.
    """
    kinds = np.array(plan.kinds, dtype=np.int8)  # a copy: the plan is left as it was
    kinds[:start] = TokenKind.COMPUTE
    spans: list[PlannedSpan] = []
    moved: dict[int, int] = {}  # old span index -> new one
    for index, span in enumerate(plan.spans):
        if index in dropped or span.end <= start:
            kinds[span.start : span.end] = TokenKind.COMPUTE
            continue
        first = max(span.start, start)
        moved[index] = len(spans)
        shift = first - span.start
        spans.append(dataclasses.replace(span, start=first, cached_start=span.cached_start + shift))
    report: list[SpanReport] = []
    for row in plan.report:
        if row.span is None or row.span in moved:
            new = None if row.span is None else moved[row.span]
            reused = 0 if new is None else spans[new].end - spans[new].start
            report.append(dataclasses.replace(row, span=new, reused=min(row.reused, reused)))
        else:
            report.append(dataclasses.replace(row, span=None, reused=0, reason=why))
    if kinds.size:
        kinds[-1] = TokenKind.COMPUTE
    return PrefillPlan(plan.token_ids, kinds, spans, report)


def plan_request(
    library: Any,
    token_ids: Sequence[int],
    start: int,
    config: BlendConfig,
) -> RequestPlan:
    """Plan one request: the rows the connector provides from ``start`` (vLLM's prefix hit) on.

    ``library`` is a `kvblend.documents.library.DocumentLibrary` (its registry finds documents, its
    `SegmentKV` tokenizes them as cached); only the store's ``contains`` is asked, nothing read.
    Whether the blend beats vLLM's own prefill is decided by the scheduler side's cost model,
    from ``rows``; the rules here are the strategy's own.
    """
    total = len(token_ids)
    ids = np.asarray(token_ids, dtype=np.int64)
    empty = PrefillPlan(ids, np.full(total, TokenKind.COMPUTE, dtype=np.int8))
    request = RequestPlan(empty, config, start, total - 1, approximate_from=total)
    if total - 1 <= start:
        request.why = RequestFallback("prefix_cached", "vLLM's prefix cache holds the whole prompt")
        return request
    decoded = _decoded(library.segment_kv.tokenizer, token_ids)
    if decoded is None:
        request.why = RequestFallback(
            "not_its_tokenization", "the prompt's token ids are not the tokenization of its text"
        )
        return request
    text, tokens = decoded
    items = library.segments_for(text)
    plan = plan_prefill(
        tokens, cached_pieces(items), lambda begin, end: library.segment_kv.layout(text[begin:end])
    )
    if config.reads_cache and not plan.spans:  # the scheduler side may say why (`NO_DOCUMENT`)
        request.why = NO_DOCUMENT
        return request
    missing, failed = _missing_spans(library, plan) if config.reads_cache else (set(), None)
    request.missing = [] if failed else _missing_documents(library, text, plan, missing)
    request.not_stored = [] if failed else _document_numbers(plan, missing)
    request.unreachable = failed
    why = f"the store could not be asked: {failed}" if failed else "not in the store yet"
    request.plan = restrict(plan, start, missing, f"{why}: computed")
    _decide(request)
    return request


def _missing_spans(library: Any, plan: PrefillPlan) -> tuple[set[int], str | None]:
    """Return the spans whose entry the store does not hold, or cannot say it holds.

    The second value says why a lookup failed (a store outage), if one did.
    """
    missing, failed = set(), None
    for index, span in enumerate(plan.spans):
        key = library.segment_kv.entry_key(span.context_ids, span.cached_ids)
        try:
            if not library.store.contains(key):
                missing.add(index)
        except Exception as error:  # noqa: BLE001 - a store outage: those rows are computed
            logger.debug("store lookup of %s failed: %s", key, error)
            missing.add(index)
            failed = failed or f"{type(error).__name__}: {error}"
    return missing, failed


def _document_numbers(plan: PrefillPlan, spans: set[int]) -> list[int]:
    """Return the numbers (from 1, in prompt order) of the documents of ``spans``."""
    documents = [row for row in plan.report if row.role == "document"]
    return [number for number, row in enumerate(documents, 1) if row.span in spans]


def _missing_documents(
    library: Any, text: str, plan: PrefillPlan, missing: set[int]
) -> list[tuple[str, str]]:
    """Return the documents (text, context) of the ``missing`` spans, to store next."""
    found = []
    for row in plan.report:
        if row.role == "document" and row.span in missing:
            document = text[row.char_start : row.char_end]
            found.append((document, library.context_for(document)))
    return found


def approximate_from(plan: PrefillPlan, config: BlendConfig) -> int:
    """Return the first row whose blended KV may differ from a full prefill's (``total``: none).

    A moved document's rows were cached behind another context, so its K/V and every row after
    it (which attends to it) are approximate; rows before the first moved row, the prompt head
    and documents reused in place behind the same head included, are what a full prefill
    computes.
    """
    total = len(plan.token_ids)
    if not config.reads_cache:
        return total
    moved = np.flatnonzero(plan.kinds == TokenKind.MOVED)
    return int(moved[0]) if moved.size else total


def _decide(request: RequestPlan) -> None:
    """Apply the strategy's budget rules to ``request.plan`` and count what the blend reuses."""
    plan, config, start = request.plan, request.config, request.start
    cached = int(np.count_nonzero(plan.kinds != TokenKind.COMPUTE))
    if config.reads_cache and not cached:
        numbers = ", ".join(map(str, request.not_stored))
        if request.unreachable:
            words = f"store unreachable: {request.unreachable}"
            request.why = RequestFallback("store_unreachable", words)
        elif request.not_stored:
            words = (
                f"not stored: the prompt's documents ({numbers}) are known but their KV is not "
                "in the store yet (the connector stores them after this request)"
            )
            request.why = RequestFallback("not_stored", words)
        else:
            request.why = RequestFallback("no_stored_document", "no stored document left to reuse")
        return
    forecast = forecast_blend(plan, config.selector())
    if forecast.fallback is not None:  # the strategy's rule (`BlendForecast.cause`)
        request.why = RequestFallback(forecast.cause or config.strategy, forecast.fallback)
        return
    request.recomputed = forecast.recomputed_tokens
    request.reused = start + (cached - request.recomputed if config.reads_cache else 0)
    request.rows = round(forecast.computed_rows)
    request.approximate_from = approximate_from(plan, config)
