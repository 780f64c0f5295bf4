"""`BlendEngine`: precompute segment KV once, blend it into any prompt, decode from the fused cache.

The engine is pure torch + transformers. It reads and writes segment KV through a store object
(anything with ``get(key, device=None)`` returning a mapping of tensors or None,
``put(key, tensors, metadata)`` and ``contains(key)``); it never touches disk itself.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..store.base import StoreError
from .blend import COMPUTE, MOVED, PREFIX, BlendInput, CachedSpan, run_blend
from .config import BlendConfig
from .decoder import Decoder
from .generation import GenerationResult, decode, decode_stream
from .loading import display_name, load_model, model_fingerprint, resolve_model
from .segments import Segment, check_segments, segment_key

if TYPE_CHECKING:
    from ..store import KVStore

logger = logging.getLogger(__name__)

_PARITY_TEXT = (
    "Blended prefill must match the model's own forward pass: the quick brown fox jumps over "
    "the lazy dog, 0123456789."
)
_KV_FORMAT = "kvblend-segment-kv/1"

#: System prompt of the RAG prompts `BlendEngine.rag_segments` builds when none is given, and so
#: part of the default document context (see `BlendEngine.rag_prefix`).
DEFAULT_SYSTEM_PROMPT = "Answer the question using only the documents."


class BlendUnavailableError(RuntimeError):
    """The model failed kvblend's parity self-check, so blending would produce wrong text."""


@dataclass
class BlendStats:
    """What a prefill did: token counts by origin and where the time went."""

    strategy: str
    prompt_tokens: int = 0
    reused_tokens: int = 0  # tokens whose KV came from a cache (prefix + moved - recomputed)
    prefix_tokens: int = 0
    moved_tokens: int = 0  # cached tokens placed at a new position
    recomputed_tokens: int = 0  # moved tokens recomputed through the last layer
    computed_tokens: int = 0  # uncached tokens, computed in full
    segments_cached: int = 0
    segments_precomputed: int = 0  # cache misses computed during this prefill
    compute_fraction: float = 0.0  # token-layers computed / token-layers of a full prefill
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def recompute_fraction(self) -> float:
        """Recomputed share of the moved tokens."""
        return self.recomputed_tokens / self.moved_tokens if self.moved_tokens else 0.0


@dataclass
class PrefillResult:
    """Next-token logits after the prompt, the prompt's token ids and the fused KV cache."""

    logits: torch.Tensor  # [vocab] float32
    token_ids: list[int]
    stats: BlendStats
    keys: list[torch.Tensor] = field(repr=False)  # per layer [kv_heads, tokens, head_dim], rotated
    values: list[torch.Tensor] = field(repr=False)


class _StoredKV:
    """Adapts a store entry (tensors ``k.{layer}``/``v.{layer}``) to the blend loop.

    A lazy entry reads its tensors while the loop runs; if a read fails there (a remote store
    gone mid-prompt, a damaged tensor), ``recompute`` produces the segment's KV instead, so the
    answer never depends on the store staying up.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor],
        recompute: Callable[[], Mapping[str, torch.Tensor]] | None = None,
    ) -> None:
        self.tensors = tensors
        self._recompute = recompute

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return self.tensors[f"k.{index}"], self.tensors[f"v.{index}"]
        except StoreError as error:
            if self._recompute is None:
                raise
            logger.warning("KV store read failed mid-prompt, recomputing the segment: %s", error)
            self.tensors, self._recompute = self._recompute(), None
            return self.tensors[f"k.{index}"], self.tensors[f"v.{index}"]


class BlendEngine:
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
        """
        self.decoder = Decoder(model)
        self.model = model
        self.tokenizer = tokenizer
        if store is None:
            from ..store import default_store  # the default wiring only; the engine sees get/put

            store = default_store()
        self.store = store
        self.kv_dtype = kv_dtype or self.decoder.dtype
        self.name = name or getattr(model.config, "name_or_path", None) or self.decoder.model_type
        self.fingerprint = model_fingerprint(model, tokenizer, self.kv_dtype)
        self._bos = self._leading_special_ids()
        self.system_prompt = system_prompt or None
        self.doc_prefix = self.rag_prefix() if doc_prefix == "auto" else (doc_prefix or None)
        self._doc_context = self._bos + (self.tokenize(self.doc_prefix) if self.doc_prefix else [])
        self.parity_error: float | None = None
        self._lock = threading.Lock()
        self._documents: dict[str, str] = {}  # text -> segment id, for finding them in prompts
        if check_parity:
            self.check_parity()

    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        store: KVStore | None = None,
        device: str | torch.device = "auto",
        dtype: torch.dtype | str | None = None,
        **kwargs: Any,
    ) -> BlendEngine:
        """Load a model (None = ``KVBLEND_MODEL`` or the bundled SmolLM2-135M) and wrap it.

        ``device="auto"`` picks CUDA when present, else CPU; ``dtype`` defaults to bf16 on CUDA
        and fp32 on CPU. Other keyword arguments go to `BlendEngine`.
        """
        resolved_device = _resolve_device(device)
        resolved_dtype = _resolve_dtype(dtype, resolved_device)
        spec = resolve_model(model)
        hf_model, tokenizer = load_model(spec, resolved_device, resolved_dtype)
        kwargs.setdefault("name", display_name(spec))
        return cls(hf_model, tokenizer, store=store, **kwargs)

    # ------------------------------------------------------------------ tokens
    @property
    def context_window(self) -> int:
        """Longest prompt plus generation the model accepts, in tokens."""
        return self.decoder.shape.max_positions

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` alone, without special tokens."""
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _leading_special_ids(self) -> list[int]:
        plain = self.tokenize("kv")
        full = list(self.tokenizer("kv")["input_ids"])
        return full[: len(full) - len(plain)] if full[-len(plain) :] == plain else []

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Render the model's chat template over ``messages``, ready for the assistant's turn."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            lines = [f"{m['role']}: {m['content']}" for m in messages]
            return "\n".join(lines) + "\nassistant:"
        return self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True
        )

    def _chat_head_tail(self, system: str | None) -> tuple[str, str]:
        """Return the chat template's text before and after the user's message."""
        system = self.system_prompt if system is None else system
        sentinel = "\ue000"
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": sentinel}
        ]
        head, tail = self.apply_chat_template(messages).split(sentinel)
        return head, tail

    def rag_prefix(self, system: str | None = None, separator: str = "\n\n") -> str:
        """Return the head of the prompts `rag_segments` builds, up to the first document.

        That is the chat template's head with the system prompt (``system=None``: the engine's
        ``system_prompt``), then ``"Documents:"`` and ``separator``.
        """
        return self._chat_head_tail(system)[0] + "Documents:" + separator

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
        if not question.strip():
            raise ValueError("the question is empty")
        head, tail = self._chat_head_tail(system)
        segments = [Segment(head + "Documents:" + separator, role="prefix")]
        for index, document in enumerate(documents):
            if index:
                segments.append(Segment(separator, cache=False))
            segments.append(Segment(document))
        segments.append(Segment(f"{separator}Question: {question}{tail}", cache=False))
        return segments

    # ------------------------------------------------------------------ parity
    def check_parity(self) -> float:
        """Compare the blend loop (strategy ``full``) with the model's forward; store the error."""
        ids = self._bos + self.tokenize(_PARITY_TEXT)
        token_ids = torch.tensor(ids, dtype=torch.long)
        with torch.inference_mode():
            expected = self.model(token_ids[None].to(self.decoder.device)).logits[0, -1].float()
        kinds = torch.full((len(ids),), COMPUTE, dtype=torch.int8)
        got = run_blend(self.decoder, BlendInput(token_ids, kinds, []), BlendConfig("full")).logits
        assert got is not None
        error = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-6))
        self.parity_error = error
        tolerance = 1e-4 if self.decoder.dtype == torch.float32 else 3e-2
        if not error <= tolerance:
            logger.error("parity self-check failed: relative error %.3g > %.3g", error, tolerance)
        return error

    def _require_parity(self) -> None:
        if self.parity_error is None:
            return
        tolerance = 1e-4 if self.decoder.dtype == torch.float32 else 3e-2
        if not self.parity_error <= tolerance:
            raise BlendUnavailableError(
                f"kvblend's layer loop does not reproduce {self.name}'s forward pass (relative "
                f"logit error {self.parity_error:.3g} > {tolerance:g}); refusing to blend rather "
                "than produce wrong text. Please report the model and transformers version."
            )

    # ------------------------------------------------------------------ precompute
    def segment_id(self, text: str) -> str:
        """Content id under which a document's KV is stored (no computation)."""
        return segment_key(self.fingerprint, self._doc_context, self.tokenize(text))

    def precompute(
        self, texts: Iterable[str], *, progress: bool | None = None, force: bool = False
    ) -> list[str]:
        """Compute and store the KV of each document text once; return their segment ids.

        Texts already in the store are skipped unless ``force``. ``progress=None`` shows a
        progress bar on a terminal for four or more texts.
        """
        from tqdm.auto import tqdm

        items = [texts] if isinstance(texts, str) else list(texts)
        for text in items:
            Segment(text)  # validates
        ids = []
        bar = tqdm(
            items,
            desc="precomputing KV",
            unit="doc",
            disable=(len(items) < 4 if progress is None else not progress) or None,
        )
        for text in bar:
            token_ids = self.tokenize(text)
            key = segment_key(self.fingerprint, self._doc_context, token_ids)
            if force or not self.store.contains(key):
                self._compute_segment(key, self._doc_context, token_ids)
            with self._lock:
                self._documents[text] = key
            ids.append(key)
        return ids

    def register(self, texts: Iterable[str]) -> None:
        """Remember document texts (already precomputed, e.g. in another process) as known."""
        items = [texts] if isinstance(texts, str) else list(texts)
        with self._lock:
            for text in items:
                self._documents[text] = self.segment_id(text)

    def known_documents(self) -> dict[str, str]:
        """Document texts this engine has precomputed or registered, mapped to segment ids."""
        with self._lock:
            return dict(self._documents)

    def _compute_segment(
        self, key: str, context: list[int], token_ids: list[int]
    ) -> dict[str, torch.Tensor]:
        """KV of ``token_ids`` computed behind ``context``; stored under ``key`` and returned."""
        self._check_length(len(context) + len(token_ids))
        ids = torch.tensor(context + token_ids, dtype=torch.long)
        kinds = torch.full((ids.numel(),), COMPUTE, dtype=torch.int8)
        out = run_blend(
            self.decoder,
            BlendInput(ids, kinds, []),
            BlendConfig("full"),
            need_logits=False,
            keep_raw_keys=True,
        )
        assert out.raw_keys is not None
        start = len(context)
        tensors: dict[str, torch.Tensor] = {}
        for layer, (keys, values) in enumerate(zip(out.raw_keys, out.values, strict=True)):
            tensors[f"k.{layer}"] = keys[:, start:].to(self.kv_dtype).contiguous()
            tensors[f"v.{layer}"] = values[:, start:].to(self.kv_dtype).contiguous()
        metadata = {
            "format": _KV_FORMAT,
            "model": self.name,
            "fingerprint": self.fingerprint,
            "layers": str(self.decoder.shape.num_layers),
            "tokens": str(len(token_ids)),
            "context_tokens": str(len(context)),
        }
        try:
            self.store.put(key, tensors, metadata)
        except Exception as error:  # noqa: BLE001 - a failing store must not fail the answer
            logger.warning("could not store segment %s: %s", key, error)
        return tensors

    def _check_length(self, tokens: int) -> None:
        limit = self.context_window
        if limit and tokens > limit:
            raise ValueError(
                f"prompt of {tokens} tokens is longer than {self.name}'s context window "
                f"of {limit} tokens"
            )

    # ------------------------------------------------------------------ prefill
    def prefill(
        self, segments: Sequence[Segment | str], config: BlendConfig | None = None
    ) -> PrefillResult:
        """Blended prefill of ``segments``; cached segments missing from the store are computed."""
        config = config or BlendConfig()
        config.validate_for(self.decoder.shape.num_layers)
        items = check_segments(segments)
        if config.strategy != "full":
            self._require_parity()
        started = time.perf_counter()
        stats = BlendStats(strategy=config.strategy)
        token_ids: list[int] = list(self._bos)
        kinds: list[int] = [COMPUTE] * len(token_ids)
        pending: list[tuple[int, int, int, str, list[int], list[int]]] = []
        prefix_ids: list[int] = list(self._bos)
        for segment in items:
            ids = self.tokenize(segment.text)
            start = len(token_ids)
            token_ids.extend(ids)
            if not segment.cache or not ids:
                kinds.extend([COMPUTE] * len(ids))
                continue
            kind = PREFIX if segment.role == "prefix" else MOVED
            context = list(prefix_ids) if kind == PREFIX else self._doc_context
            if kind == PREFIX:
                prefix_ids.extend(ids)
            elif start == len(self._doc_context) and token_ids[:start] == self._doc_context:
                # A document right after the head it was precomputed behind: its cached KV is
                # what a full prefill computes here, so it is reused exactly, like a prefix.
                kind = PREFIX
            kinds.extend([kind] * len(ids))
            pending.append(
                (
                    start,
                    start + len(ids),
                    kind,
                    segment_key(self.fingerprint, context, ids),
                    context,
                    ids,
                )
            )
        self._check_length(len(token_ids))
        if not token_ids:
            raise ValueError("the prompt has no tokens")
        kinds[-1] = COMPUTE  # the last token is always computed: it produces the logits
        stats.timings["tokenize_s"] = time.perf_counter() - started

        spans: list[CachedSpan] = []
        lookup_started = time.perf_counter()
        if config.strategy != "full":
            for start, end, kind, key, context, ids in pending:
                entry = self.store.get(key, device=self.decoder.device)
                if entry is None:
                    entry = self._compute_segment(key, context, ids)
                    stats.segments_precomputed += 1
                stats.segments_cached += 1
                recompute = functools.partial(self._compute_segment, key, context, ids)
                spans.append(CachedSpan(start, end, _StoredKV(entry, recompute), kind))
        stats.timings["lookup_s"] = time.perf_counter() - lookup_started

        kind_tensor = torch.tensor(kinds, dtype=torch.int8)
        compute_started = time.perf_counter()
        out = run_blend(
            self.decoder, BlendInput(torch.tensor(token_ids), kind_tensor, spans), config
        )
        assert out.logits is not None
        stats.timings["blend_s"] = time.perf_counter() - compute_started
        stats.timings["load_s"] = out.stats["load_s"]
        if config.strategy == "attention":
            stats.timings["probe_s"] = out.stats["probe_s"]
        stats.timings["prefill_s"] = time.perf_counter() - started
        stats.prompt_tokens = len(token_ids)
        if config.strategy == "full":
            stats.computed_tokens = len(token_ids)
        else:
            stats.prefix_tokens = int((kind_tensor == PREFIX).sum())
            stats.moved_tokens = int((kind_tensor == MOVED).sum())
            stats.recomputed_tokens = int(out.stats["recomputed_tokens"])
            stats.computed_tokens = int((kind_tensor == COMPUTE).sum())
            stats.reused_tokens = stats.prefix_tokens + stats.moved_tokens - stats.recomputed_tokens
        stats.compute_fraction = out.stats["token_layers"] / out.stats["token_layers_full"]
        return PrefillResult(out.logits, token_ids, stats, out.keys, out.values)

    # ------------------------------------------------------------------ generation
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
    ) -> GenerationResult:
        """Blended prefill, then decoding from the fused cache; returns text, TTFT and stats."""
        started = time.perf_counter()
        pre = segments if isinstance(segments, PrefillResult) else self.prefill(segments, config)
        return decode(
            self.model, self.tokenizer, pre.token_ids, pre.logits, pre.keys, pre.values, pre.stats,
            started=started, max_new_tokens=max_new_tokens, temperature=temperature,
            top_p=top_p, stop=stop, seed=seed,
        )  # fmt: skip

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
    ) -> Iterator[str]:
        """Like `generate`, yielding text pieces as they are decoded."""
        pre = segments if isinstance(segments, PrefillResult) else self.prefill(segments, config)
        yield from decode_stream(
            self.model, self.tokenizer, pre.token_ids, pre.logits, pre.keys, pre.values,
            max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
            stop=stop, seed=seed,
        )  # fmt: skip


def _resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "fp16": torch.float16,
        "float16": torch.float16,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(names)}")
    return names[dtype]
