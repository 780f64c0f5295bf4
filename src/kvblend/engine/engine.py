"""`BlendEngine`: precompute segment KV once, blend it into any prompt, decode from the fused cache.

The engine is pure torch + transformers. It reads and writes segment KV through a store object
(anything with ``get(key, device=None)`` returning a mapping of tensors or None,
``put(key, tensors, metadata)`` and ``contains(key)``); it never touches disk itself.

This module builds the engine and runs its prompts: `plan`, `explain` and `prefill` (where the
blend loop, `run_blend`, runs) and the parity self-check. The documents are a `DocumentLibrary`
(`kvblend.documents.library`), and the engine's document methods (``precompute``, ``register``,
``is_known``, ``segment_id``, ``segments_for``) are `DocumentsMixin`'s
(`kvblend.engine.documents_mixin`); ``generate``, ``generate_batch`` and ``stream`` are
`GenerationMixin`'s (`kvblend.engine.generation_mixin`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvblend.blend.config import BlendConfig, check_config
from kvblend.blend.forecast import forecast_blend
from kvblend.blend.loop import BlendInput, CachedSpan, run_blend
from kvblend.decoding.cache import check_environment
from kvblend.documents.library import DocumentLibrary
from kvblend.documents.registry import DEFAULT_CAPACITY
from kvblend.engine.documents_mixin import DocumentsMixin
from kvblend.engine.explain import Explanation, FallbackLog
from kvblend.engine.generation_mixin import GenerationMixin
from kvblend.engine.parity import PARITY_TEXT, parity_error, parity_tolerance, require_parity
from kvblend.engine.results import BlendStats, PrefillResult, count_tokens
from kvblend.engine.threads import use_threads
from kvblend.models.decoder import Decoder
from kvblend.models.loading import (
    display_name,
    load_model,
    model_fingerprint,
    resolve_device,
    resolve_dtype,
    resolve_model,
)
from kvblend.prompt import templates
from kvblend.prompt.plan import PrefillPlan, cached_pieces, plan_prefill
from kvblend.prompt.segments import PromptLike, Segment
from kvblend.prompt.splice import splice_rules
from kvblend.prompt.tokens import encode_in_background, encode_prompt, prompt_tokens
from kvblend.validation import (
    ContextWindow,
    check_cancel,
    check_prompt,
    check_text,
    longest_token_chars,
)

if TYPE_CHECKING:
    from kvblend.store import KVStore

__all__ = ["DEFAULT_SYSTEM_PROMPT", "BlendEngine"]

logger = logging.getLogger(__name__)

#: System prompt of the RAG prompts `BlendEngine.rag_segments` builds when none is given, and so
#: part of the default document context (see `BlendEngine.rag_prefix`).
DEFAULT_SYSTEM_PROMPT = "Answer the question using only the documents."


def _default_store() -> KVStore:
    """Build the store of an engine given none (the default wiring; the engine sees get/put)."""
    from kvblend.store import default_store

    return default_store()


class BlendEngine(DocumentsMixin, GenerationMixin):
    """Blended prefill and generation over one Hugging Face decoder model."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        store: KVStore | None = None,
        kv_dtype: torch.dtype | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        doc_prefix: str | None = "auto",
        name: str | None = None,
        check_parity: bool = True,
        max_documents: int = DEFAULT_CAPACITY,
        threads: int | None = None,
    ) -> None:
        """Wrap a loaded model; prefer `BlendEngine.from_pretrained`.

        Args:
            model: a transformers causal LM of a supported family, in eval mode.
            tokenizer: its tokenizer.
            store: where segment KV lives; None builds `kvblend.store.default_store()`.
            kv_dtype: dtype of stored KV (default: the model's dtype).
            system_prompt: system prompt of the prompts `rag_segments` builds when the call
                names none ("" or None: no system message); with ``doc_prefix="auto"`` it is
                also what documents are precomputed behind, so set it to the one your prompts use.
            doc_prefix: text every document is precomputed behind (its KV is discarded), so a
                document's first tokens are not computed as the start of a sequence and see the
                kind of text they follow in a prompt. ``"auto"`` (default): `rag_prefix`, the
                head of a chat RAG prompt with ``system_prompt`` (a document placed first in
                such a prompt is then reused exactly); None: behind the BOS token alone.
            name: model name reported to users (default: the model's config name).
            check_parity: run the parity self-check now (recommended).
            max_documents: documents the registry keeps for finding them in prompt strings
                (least recently matched dropped first).
            threads: torch CPU threads, for the whole process (`kvblend.engine.threads`);
                None: the cores the last minute's load leaves idle, unless the process chose
                a count already. ``engine.threads`` is the count in use.
        """
        self.threads = use_threads(threads)
        self.decoder = Decoder(model)
        self.model = model
        self.tokenizer = tokenizer
        self.store = store if store is not None else _default_store()
        self.kv_dtype = kv_dtype or self.decoder.dtype
        self.name = name or getattr(model.config, "name_or_path", None) or self.decoder.model_type
        self.fingerprint = model_fingerprint(model, tokenizer, self.kv_dtype)
        #: The resolved model spec `from_pretrained` loaded (None for a model passed in).
        self.model_spec: str | None = None
        self.system_prompt = system_prompt or None
        self.doc_prefix = self.rag_prefix() if doc_prefix == "auto" else (doc_prefix or None)
        self.parity_error: float | None = None
        #: The window every prompt and document must fit.
        self._window = ContextWindow(
            self.decoder.shape.max_positions, longest_token_chars(tokenizer), self.name
        )
        self._fallback_log = FallbackLog(logger)  # each cause once a minute
        self._connect_store(max_documents)
        if check_parity:
            self.check_parity()

    def _connect_store(self, max_documents: int) -> None:
        """Build what reads and writes this engine's entries and finds its documents."""
        #: This engine's documents: their KV in the store and the registry finding them.
        self.library = DocumentLibrary(
            self.decoder, self.tokenizer, self.store, fingerprint=self.fingerprint,
            doc_prefix=self.doc_prefix, kv_dtype=self.kv_dtype, model_name=str(self.name),
            window=self._window, capacity=max_documents,
        )  # fmt: skip
        #: Computes, checks and opens the store entries of segment KV.
        self.segment_kv = self.library.segment_kv
        #: The documents this engine finds in prompt strings, shared with every engine over the
        #: same store and model, whatever their document context (see `kvblend.documents.registry`).
        self.documents = self.library.registry

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        store: KVStore | None = None,
        device: str | torch.device = "auto",
        dtype: torch.dtype | str | None = None,
        *,
        revision: str | None = None,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> BlendEngine:
        """Load a model (None = ``KVBLEND_MODEL`` or the bundled SmolLM2-135M) and wrap it.

        ``device="auto"`` picks CUDA when present, else CPU; ``dtype`` defaults to bf16 on CUDA
        and fp32 on CPU. ``revision``, ``trust_remote_code`` and ``model_kwargs`` go to
        transformers' ``from_pretrained`` (see `kvblend.models.loading.LOADING_OPTIONS`). Other
        keyword arguments go to `BlendEngine` (``threads`` is applied before loading).
        """
        kwargs["threads"] = use_threads(kwargs.get("threads"))
        check_environment()  # KVBLEND_DECODE_CACHE / _COMPILE: refused before the model loads
        resolved_device = resolve_device(device)
        resolved_dtype = resolve_dtype(dtype, resolved_device)
        spec = resolve_model(model)
        hf_model, tokenizer = load_model(
            spec, resolved_device, resolved_dtype, revision=revision,
            trust_remote_code=trust_remote_code, model_kwargs=model_kwargs,
        )  # fmt: skip
        kwargs.setdefault("name", display_name(spec))
        engine = cls(hf_model, tokenizer, store=store, **kwargs)
        engine.model_spec = spec
        return engine

    # ------------------------------------------------------------------ tokens
    @property
    def context_window(self) -> int:
        """Longest prompt plus generation the model accepts, in tokens."""
        return self.decoder.shape.max_positions

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` alone, without special tokens."""
        check_text(text, "text")
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode(self, prompt: str) -> list[int]:
        """Token ids the model reads for ``prompt``: the whole text, tokenized once.

        Equal to ``tokenizer(prompt)["input_ids"]``, except that a prompt already starting with
        the BOS token (written by a chat template) gets no second one, as in transformers'
        chat pipeline.
        """
        check_text(prompt, "prompt")
        return encode_prompt(self.tokenizer, prompt).ids.tolist()

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Render the model's chat template over ``messages``, ready for the assistant's turn."""
        return templates.apply_chat_template(self.tokenizer, messages)

    def rag_prefix(self, system: str | None = None, separator: str = "\n\n") -> str:
        """Return the head of the prompts `rag_segments` builds, up to the first document.

        That is the chat template's head with the system prompt (``system=None``: the engine's
        ``system_prompt``), then ``"Documents:"`` and ``separator``.
        """
        return templates.rag_prefix(
            self.tokenizer, self.system_prompt if system is None else system, separator
        )

    def rag_segments(
        self,
        question: str,
        documents: Sequence[str],
        *,
        system: str | None = None,
        separator: str = "\n\n",
    ) -> list[Segment]:
        """Segments of a chat-formatted RAG prompt: template head, documents, question.

        The template head (system prompt and the start of the user turn) is a cached prefix;
        each document is a cached segment; separators, the question and the template tail are
        computed in full. ``system=None`` uses the engine's ``system_prompt``; ``""`` none.
        """
        return templates.rag_segments(
            self.tokenizer,
            question,
            documents,
            system=self.system_prompt if system is None else system,
            separator=separator,
        )

    # ------------------------------------------------------------------ parity
    def check_parity(self) -> float:
        """Compare the blend loop (strategy ``full``) with the model's forward; store the error."""
        error = parity_error(self.model, self.decoder, self.encode(PARITY_TEXT))
        self.parity_error = error
        tolerance = parity_tolerance(self.decoder.dtype)
        if not error <= tolerance:
            logger.error("parity self-check failed: relative error %.3g > %.3g", error, tolerance)
        return error

    # ------------------------------------------------------------------ planning
    def plan(self, prompt: PromptLike) -> PrefillPlan:
        """Tokenize the whole prompt (documents' known tokens spliced in); plan each token's KV."""
        early = None  # a tokenizer that cannot splice tokenizes the string while matching
        rules = splice_rules(self.tokenizer)
        if isinstance(prompt, str) and prompt and rules is None:
            check_text(prompt, "the prompt")
            self._window.check_chars(len(prompt))
            early = encode_in_background(self.tokenizer, prompt)
        items = self._segments(prompt)
        text = "".join(segment.text for segment in items)
        self._window.check_chars(len(text))
        pieces = cached_pieces(items)
        layouts = {(p.start, p.end): self.segment_kv.layout(text[p.start : p.end])
                   for p in pieces if p.role == "document"}  # fmt: skip
        tokens = early.result() if early else prompt_tokens(self.tokenizer, text, layouts, rules)
        self._window.check_length(tokens.ids.size)
        if not tokens.ids.size:
            raise ValueError("the prompt has no tokens")
        return plan_prefill(tokens, pieces, lambda start, end: layouts[start, end])

    def explain(self, prompt: PromptLike, config: BlendConfig | None = None) -> Explanation:
        """Show, without running the model, what `prefill` with ``config`` would do, and why.

        The counts (reused, recomputed, computed tokens), the fallback reason and the documents
        not reused are the ones `prefill` reports for the same prompt and config: both come
        from `forecast_blend` over the same plan.
        """
        check_config(config)
        check_prompt(prompt)
        config = config or BlendConfig()
        config.check_model(self.decoder.shape)
        items = self._segments(prompt)
        plan = self.plan(items)
        text = "".join(segment.text for segment in items)
        return Explanation(
            text, plan, self.library.stored_spans(plan), len(self.documents),
            forecast_blend(plan, config), config.strategy, self.library.near_miss(prompt, items),
        )  # fmt: skip

    # ------------------------------------------------------------------ prefill
    def prefill(
        self,
        prompt: PromptLike,
        config: BlendConfig | None = None,
        *,
        cancel: threading.Event | None = None,
    ) -> PrefillResult:
        """Blended prefill of a prompt: a string (known documents are found in it) or segments.

        Cached segments missing from the store, or whose entry cannot be read, are computed
        (and stored) within the call. ``stats.fallback`` says why a blend ran as full prefill
        (and ``stats.documents_lost`` why a found document was not reused); each cause is
        logged once a minute. ``cancel``: once set, the prefill stops before its next layer and
        raises `BlendCancelledError`.
        """
        check_config(config)
        check_prompt(prompt)
        check_cancel(cancel)
        config = config or BlendConfig()
        config.check_model(self.decoder.shape)
        if config.reads_cache:
            require_parity(self.parity_error, self.decoder.dtype, str(self.name))
        started = time.perf_counter()
        items = self._segments(prompt)
        plan = self.plan(items)
        stats = BlendStats(strategy=config.strategy)
        stats.timings["tokenize_s"] = time.perf_counter() - started
        forecast = forecast_blend(plan, config)
        stats.strategy_run, stats.fallback = forecast.strategy_run, forecast.fallback
        stats.estimated_cost = forecast.estimated_cost
        stats.documents_lost = list(forecast.documents_lost)
        stats.near_miss = self.library.near_miss(prompt, items)
        kinds = torch.from_numpy(plan.kinds.copy())  # the loop's own: the plan stays as planned
        token_ids = torch.from_numpy(plan.token_ids.copy())
        lookup_started = time.perf_counter()
        spans: list[CachedSpan] = []
        if config.reads_cache:
            spans, stats.segments_precomputed = self.segment_kv.open_spans(plan)
            stats.segments_cached = len(spans)
        stats.timings["lookup_s"] = time.perf_counter() - lookup_started
        compute_started = time.perf_counter()
        blend_input = BlendInput(token_ids, kinds, spans, kinds.numpy())
        out = run_blend(self.decoder, blend_input, config, cancel=cancel)
        assert out.logits is not None
        # entries that failed while their layers were read, recomputed in place
        stats.segments_precomputed += sum(
            bool(getattr(s.source, "recomputed", False)) for s in spans
        )
        stats.timings["blend_s"] = time.perf_counter() - compute_started
        stats.timings["load_s"] = out.stats["load_s"]
        stats.timings["probe_s"] = out.stats["probe_s"]  # a selector's first pass (0: none)
        stats.timings["prefill_s"] = time.perf_counter() - started
        count_tokens(stats, plan, kinds, out.stats, config.reads_cache)
        self._fallback_log.report(stats, len(self.documents))
        return PrefillResult(out.logits, plan.token_ids.tolist(), stats, out.keys, out.values)
