"""`BlendEngine`: precompute segment KV once, blend it into any prompt, decode from the fused cache.

The engine is pure torch + transformers. It reads and writes segment KV through a store (a
`kvblend.store.KVStore`: ``get(key, device=None, *, expect=None)``, ``put``, ``contains``...);
it never touches disk itself.

`BlendEngine` is the facade users call; each method checks its input once and hands over to the
package that does the work: prompts (`kvblend.prompt`: segments, templates, token ids, the
plan), documents (`kvblend.documents.library.DocumentLibrary`: precompute, the registry that
finds them in prompts, their entries in the store), the blend (`kvblend.documents.blend_plan`:
the plan's entries opened, then `kvblend.blend.prefill.run_blend`) and decoding from the fused
cache (`kvblend.decoding`), plus the parity self-check (`kvblend.models.parity`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvblend.blend.config import BlendConfig, check_config
from kvblend.blend.forecast import FallbackLog, forecast_blend
from kvblend.blend.kv_codec import KVCodec
from kvblend.blend.kv_codec import kv_codec as resolve_codec
from kvblend.blend.prefill import device_clock, device_times
from kvblend.decoding.batch import decode_batch
from kvblend.decoding.cache import check_environment
from kvblend.decoding.generation import GenerationResult, check_margins, decode, decode_stream
from kvblend.decoding.options import DecodeOptions
from kvblend.documents.blend_plan import blend_plan
from kvblend.documents.library import DocumentLibrary
from kvblend.documents.precompute import DEFAULT_BATCH_TOKENS
from kvblend.documents.registry import DEFAULT_CAPACITY
from kvblend.engine.explain import Explanation
from kvblend.engine.results import (
    BlendStats,
    PrefillResult,
    count_tokens,
    escalation,
    record_device_times,
)
from kvblend.engine.torch_threads import use_threads
from kvblend.errors import BlendCancelledError
from kvblend.models.decoder import Decoder
from kvblend.models.dtypes import AUTO, DtypeChoice, choose_dtype
from kvblend.models.fingerprint import model_fingerprint
from kvblend.models.loading import (
    checkpoint_dtype,
    display_name,
    load_model,
    resolve_device,
    resolve_model,
)
from kvblend.models.parity import (
    PARITY_TEXT,
    forward_logits,
    parity_error,
    parity_tolerance,
    require_parity,
)
from kvblend.prompt import templates
from kvblend.prompt.plan import PrefillPlan, cached_pieces, plan_prefill
from kvblend.prompt.segments import PromptLike, Segment, check_segments
from kvblend.prompt.splice import splice_rules
from kvblend.prompt.templates import DEFAULT_SYSTEM_PROMPT
from kvblend.prompt.tokens import encode_in_background, encode_prompt, prompt_tokens
from kvblend.validation import (
    check_cancel,
    check_prompt,
    check_text,
)

if TYPE_CHECKING:
    from kvblend.store import KVStore

__all__ = ["DEFAULT_SYSTEM_PROMPT", "BlendEngine"]

logger = logging.getLogger(__name__)


def _default_store() -> KVStore:
    """Build the store of an engine given none (the default wiring; the engine sees get/put)."""
    from kvblend.store import default_store

    return default_store()


class BlendEngine:
    """Blended prefill and generation over one Hugging Face decoder model."""

    #: The resolved model spec `from_pretrained` loaded (None for a model passed in).
    model_spec: str | None = None
    #: The dtype the model computes in and why: `from_pretrained`'s choice (``dtype="auto"``:
    #: `kvblend.models.dtypes`' rule), else the dtype of the model passed in.
    dtype_choice: DtypeChoice

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
        kv_codec: str | KVCodec | None = None,
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
            threads: torch CPU threads, for the whole process (`kvblend.engine.torch_threads`);
                None: the cores the last minute's load leaves idle, unless the process chose
                a count already. ``engine.threads`` is the count in use.
            kv_codec: how stored KV is encoded (`kvblend.blend.kv_codec`): None, int8, k8v4, int4.
        """
        self.threads = use_threads(threads)
        self.decoder = Decoder(model)
        self.model = model
        self.tokenizer = tokenizer
        self.store = store if store is not None else _default_store()
        self.kv_dtype = kv_dtype or self.decoder.dtype
        self.name = name or getattr(model.config, "name_or_path", None) or self.decoder.model_type
        self.fingerprint = model_fingerprint(model, tokenizer, self.kv_dtype)
        self.dtype_choice = DtypeChoice(self.decoder.dtype, "model", self.decoder.device.type)
        self.system_prompt = system_prompt or None
        self.doc_prefix = self.rag_prefix() if doc_prefix == "auto" else (doc_prefix or None)
        self.parity_error: float | None = None
        self._fallback_log = FallbackLog(logger)  # each cause once a minute
        self._open_library(max_documents, kv_codec)
        if check_parity:
            self.check_parity()

    def _open_library(self, max_documents: int, kv_codec: str | KVCodec | None) -> None:
        """Open this engine's documents: their KV in the store and the registry finding them."""
        self.library = DocumentLibrary.open(
            self.decoder,
            self.tokenizer,
            self.store,
            fingerprint=self.fingerprint,
            model_name=str(self.name),
            doc_prefix=self.doc_prefix,
            kv_dtype=self.kv_dtype,
            codec=kv_codec,
            capacity=max_documents,
        )
        #: How documents' KV is stored: full precision (``none``) or a quantized codec.
        self.kv_codec = self.library.segment_kv.codec
        #: The window every prompt and document must fit.
        self._window = self.library.window

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        store: KVStore | None = None,
        device: str | torch.device = "auto",
        dtype: torch.dtype | str | None = AUTO,
        *,
        revision: str | None = None,
        trust_remote_code: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> BlendEngine:
        """Load a model (None = ``KVBLEND_MODEL`` or the bundled SmolLM2-135M) and wrap it.

        ``device="auto"`` picks CUDA when present, else CPU. ``dtype="auto"`` (or None): bfloat16
        where the device has bfloat16 matrix units (CUDA compute capability 8.0+, a CPU with
        AVX512-BF16 or AMX) unless the checkpoint is stored in float32, float32 elsewhere
        (`kvblend.models.dtypes`); ``engine.dtype_choice`` says which and why, and it is logged.
        ``"float32"`` is the exact reference. ``revision``, ``trust_remote_code`` and
        ``model_kwargs`` go to transformers' ``from_pretrained`` (see
        `kvblend.models.loading.LOADING_OPTIONS`). Other keyword arguments go to `BlendEngine`
        (``threads`` is applied before loading).
        """
        kwargs["threads"] = use_threads(kwargs.get("threads"))
        resolve_codec(kwargs.get("kv_codec"))  # an unknown codec is refused before the load
        check_environment()  # KVBLEND_DECODE_CACHE / _COMPILE: refused before the model loads
        resolved_device = resolve_device(device)
        spec = resolve_model(model)
        options: dict[str, Any] = dict(
            revision=revision, trust_remote_code=trust_remote_code, model_kwargs=model_kwargs
        )
        choice = choose_dtype(dtype, resolved_device, lambda: checkpoint_dtype(spec, **options))
        hf_model, tokenizer = load_model(spec, resolved_device, choice.dtype, **options)
        logger.info("%s computes in %s", display_name(spec), choice)
        kwargs.setdefault("name", display_name(spec))
        engine = cls(hf_model, tokenizer, store=store, **kwargs)
        engine.model_spec = spec
        engine.dtype_choice = choice
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

    # ------------------------------------------------------------------ documents
    def segment_id(self, text: str) -> str:
        """Content id under which a document's KV is stored (no computation)."""
        check_text(text, "text")
        return self.library.segment_kv.key(text)

    def precompute(
        self,
        texts: Iterable[str],
        *,
        progress: bool | None = None,
        force: bool = False,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
    ) -> list[str]:
        """Compute and store the KV of each document text once; return their segment ids.

        A text whose entry is in the store and reads back intact is skipped (``force``: always
        recomputed); an entry that cannot be read is dropped and recomputed. The others are
        computed in batches of documents of similar length, ``batch_tokens`` (documents x
        longest document, in tokens) at most per forward pass (`kvblend.documents.precompute`).
        Every text becomes known to the document registry, so any process sharing the store
        finds it in prompts. ``progress=None`` shows a progress bar on a terminal for four or
        more texts.
        """
        return self.library.precompute(
            texts, progress=progress, force=force, batch_tokens=batch_tokens
        )

    def register(self, texts: Iterable[str]) -> None:
        """Make document texts known without computing anything (their KV is computed on use).

        Rarely needed: documents precomputed by any process sharing the store are known.
        """
        self.library.register(texts)

    def is_known(self, text: str) -> bool:
        """Whether ``text`` is in the document registry (found when it occurs in a prompt)."""
        return self.library.is_known(text)

    def segments_for(self, prompt: str, *, cache_prefix: bool = False) -> list[Segment]:
        """Cut a prompt string into segments: the known documents in it and the text between.

        ``cache_prefix``: the text before the first document is cached as a prefix.
        """
        return self.library.segments_for(prompt, cache_prefix=cache_prefix)

    def _segments(self, prompt: PromptLike) -> list[Segment]:
        """Return a prompt as segments: a string cut by `segments_for`, a segment list checked."""
        if isinstance(prompt, str):
            return self.segments_for(prompt)
        return check_segments(prompt)

    # ------------------------------------------------------------------ parity
    def check_parity(self) -> float:
        """Compare the blend loop (strategy ``full``) with the model's forward; store the error."""
        ids = self.encode(PARITY_TEXT)
        error = parity_error(
            self.decoder, forward_logits(self.model, ids, self.decoder.device), ids
        )
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
        layouts = {
            (p.start, p.end): self.library.segment_kv.layout(text[p.start : p.end])
            for p in pieces
            if p.role == "document"
        }
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
        selector = config.selector()
        selector.check_model(self.decoder.shape)
        items = self._segments(prompt)
        plan = self.plan(items)
        text = "".join(segment.text for segment in items)
        return Explanation(
            text,
            plan,
            self.library.stored_spans(plan),
            len(self.library.registry),
            forecast_blend(plan, selector),
            config.strategy,
            self.library.near_miss(prompt, items),
            config.settings.get("guard"),
            config.settings.get("guard_signal", "shift"),
        )

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
        _check_call(prompt, config, cancel)
        return self._prefill(prompt, config or BlendConfig(), cancel)

    def _prefill(
        self, prompt: PromptLike, config: BlendConfig, cancel: threading.Event | None
    ) -> PrefillResult:
        """`prefill` of arguments already checked (`_check_call`)."""
        selector = config.selector()  # the prefill's own: its forecast and its blend
        selector.check_model(self.decoder.shape)
        if selector.reads_cache:
            require_parity(self.parity_error, self.decoder.dtype, str(self.name))
        started = time.perf_counter()
        items = self._segments(prompt)
        plan = self.plan(items)
        stats = BlendStats(strategy=config.strategy)
        stats.timings["tokenize_s"] = time.perf_counter() - started
        forecast = forecast_blend(plan, selector)
        stats.strategy_run, stats.fallback = forecast.strategy_run, forecast.fallback
        stats.fallback_cause = forecast.cause
        stats.estimated_cost = forecast.estimated_cost
        stats.near_miss = self.library.near_miss(prompt, items)
        clock = device_clock(self.decoder.device)
        # entries opened lazily; a missing, unreadable or failing one computed (and stored)
        blended = blend_plan(self.decoder, self.library.segment_kv, plan, selector, cancel=cancel)
        out = blended.out
        assert out.logits is not None
        stats.segments_cached, stats.segments_precomputed = len(blended.spans), blended.computed
        stats.timings["lookup_s"], stats.timings["blend_s"] = blended.open_s, blended.loop_s
        stats.timings["load_s"] = out.counts.load_s
        stats.timings["probe_s"] = out.counts.probe_s  # a selector's first passes (0: none)
        stats.uncompiled_calls = out.counts.uncompiled_calls
        record_device_times(stats, device_times(clock, out))  # CUDA: waits for the logits
        stats.timings["prefill_s"] = time.perf_counter() - started
        layers = self.decoder.shape.num_layers
        count_tokens(stats, plan, blended.kinds, out, layers, selector.reads_cache)
        lost = escalation(stats, plan, forecast, out.guard)
        stats.documents_lost = [str(item) for item in lost]  # the records, in words
        self._fallback_log.report(
            stats.fallback, stats.fallback_cause, lost, stats.near_miss, len(self.library.registry)
        )
        return PrefillResult(out.logits, plan.token_ids.tolist(), stats, out.keys, out.values)

    # ------------------------------------------------------------------ generation
    def _prefilled(
        self,
        prompt: PromptLike | PrefillResult,
        config: BlendConfig | None,
        cancel: threading.Event | None = None,
    ) -> PrefillResult:
        """``prompt`` itself when it is a prefill result already, else its prefill.

        The caller checked the arguments (`_check_call`), so the prefill does not again.
        """
        if isinstance(prompt, PrefillResult):
            return prompt
        return self._prefill(prompt, config or BlendConfig(), cancel)

    def generate(
        self,
        segments: Sequence[Segment | str] | PrefillResult,
        config: BlendConfig | None = None,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        cancel: threading.Event | None = None,
        top_k: int = 0,
        repetition_penalty: float = 1.0,
        do_sample: bool | None = None,
        margins: int = 0,
    ) -> GenerationResult:
        """Blended prefill, then decoding from the fused cache; returns text, TTFT and stats.

        The decoding options are transformers' (see `kvblend.decoding.options.DecodeOptions`):
        ``temperature=0`` decodes greedily unless ``do_sample=True``; ``top_k``, ``top_p`` and
        ``repetition_penalty`` go through transformers' own logits processors, for the first
        token (drawn from the blended logits) as for every later one. ``cancel``: once set,
        prefill stops before its next layer and decoding after its next token; either raises
        `BlendCancelledError`. ``margins``: the number of first new tokens whose margin (the
        model's probability of its most likely token minus the second's, before any processor)
        `GenerationResult.margins` records, taken from the logits decoding makes anyway and
        read once after it (0, the default: none).
        """
        started = time.perf_counter()
        options: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            repetition_penalty=repetition_penalty,
            do_sample=do_sample,
            stop=stop,
            seed=seed,
        )
        DecodeOptions(**options).check()  # before any model work
        check_margins(margins)
        _check_call(segments, config, cancel)
        pre = self._prefilled(segments, config, cancel)
        return decode(
            self.model,
            self.tokenizer,
            pre.token_ids,
            pre.logits,
            pre.keys,
            pre.values,
            pre.stats,
            started=started,
            cancel=cancel,
            margins=margins,
            **options,
        )

    def generate_batch(
        self,
        prompts: Sequence[PromptLike | PrefillResult],
        config: BlendConfig | None = None,
        **options: Any,
    ) -> list[GenerationResult]:
        """`generate` for several prompts: each prefilled on its own, then decoded together.

        ``options`` are `generate`'s decoding keywords, common to every prompt. One batched
        decode reads the weights once per step for every prompt; each result equals that
        prompt's own `generate` (positions stay exact under the padding), up to floating-point
        rounding of the batched kernels. A prompt whose output budget the context window clips
        is decoded alone. Each result's ``ttft_s`` is the time from the call to the first tokens
        of the whole batch (every prompt prefilled), and its ``stats.timings["prefill_s"]`` that
        prompt's own prefill.
        """
        started = time.perf_counter()
        DecodeOptions(**options).check()  # an unknown keyword is a TypeError here
        if isinstance(prompts, (str, PrefillResult)) or not isinstance(prompts, Sequence):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        for prompt in prompts:  # every one, before the first prefill
            _check_call(prompt, config, None)
        pres = [self._prefilled(prompt, config) for prompt in prompts]
        budget = int(options.get("max_new_tokens", 64))
        limit = self.context_window
        fits = [i for i, p in enumerate(pres) if not limit or len(p.token_ids) + budget <= limit]
        results: dict[int, GenerationResult] = {}
        if len(fits) > 1:
            batch = [pres[i] for i in fits]
            decoded = decode_batch(self.model, self.tokenizer, batch, started=started, **options)
            results.update(zip(fits, decoded, strict=True))
        for index, pre in enumerate(pres):
            if index not in results:
                results[index] = self.generate(pre, **options)
        return [results[index] for index in range(len(pres))]

    def stream(
        self,
        segments: Sequence[Segment | str] | PrefillResult,
        config: BlendConfig | None = None,
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        seed: int | None = None,
        cancel: threading.Event | None = None,
        top_k: int = 0,
        repetition_penalty: float = 1.0,
        do_sample: bool | None = None,
    ) -> Iterator[str]:
        """Like `generate`, yielding text pieces as they are decoded."""
        options: dict[str, Any] = dict(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            repetition_penalty=repetition_penalty,
            do_sample=do_sample,
            stop=stop,
            seed=seed,
        )
        DecodeOptions(**options).check()  # before any model work
        _check_call(segments, config, cancel)
        pre = self._prefilled(segments, config, cancel)
        for piece in decode_stream(
            self.model, self.tokenizer, pre.token_ids, pre.logits, pre.keys, pre.values, **options
        ):
            if cancel is not None and cancel.is_set():  # closing decode_stream stops decoding
                raise BlendCancelledError("the generation was cancelled")
            yield piece


def _check_call(prompt: object, config: object, cancel: object) -> None:
    """Refuse a prompt, config or cancel event of the wrong type, before any model work."""
    if not isinstance(prompt, PrefillResult):
        check_prompt(prompt)
    check_config(config)
    check_cancel(cancel)
