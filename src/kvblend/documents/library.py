"""An engine's documents: their KV in the store, and the registry that finds them in prompts.

`DocumentLibrary` wires a `SegmentKV` (computing, checking and opening the store entries of
document KV) to a `DocumentRegistry` (the documents found in prompt strings, shared by every
engine over the same store and model) for one model and document context;
`DocumentLibrary.open` is how the engine and the vLLM connector both build one. It checks documents
before anything is computed, precomputes and registers them, chooses the stored context a
document's KV is read from, cuts a prompt string into the known documents in it and the text
between, and tells which of a plan's documents the store holds. `BlendEngine`'s document
methods (``precompute``, ``register``, ``is_known``, ``segment_id``, ``segments_for``) are
answered here.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.kv_codec import NO_CODEC, KVCodec, kv_codec
from kvblend.documents.precompute import DEFAULT_BATCH_TOKENS
from kvblend.documents.progress import PrecomputeBar, PrecomputeProgress, ProgressListener
from kvblend.documents.registry import DEFAULT_CAPACITY, DocumentRegistry
from kvblend.documents.segment_kv import SegmentKV
from kvblend.prompt.plan import PrefillPlan, cached_pieces
from kvblend.prompt.segments import KV_LAYOUT, Segment
from kvblend.validation import (
    ContextWindow,
    check_count,
    check_text,
    check_texts,
    longest_token_chars,
    short,
    snippet,
    tokens_beyond,
)

if TYPE_CHECKING:
    from kvblend.store.base import KVStore

logger = logging.getLogger(__name__)


def registry_log(fingerprint: str) -> str:
    """One log per model and KV layout: documents behind every context are found."""
    digest = hashlib.sha256(f"{fingerprint}|{KV_LAYOUT}|registry/2".encode()).hexdigest()
    return f"documents-{digest[:32]}"


class DocumentLibrary:
    """The documents one engine computes, stores and finds, behind its document context."""

    def __init__(
        self,
        decoder: ModelAdapter,
        tokenizer: Any,
        store: KVStore,
        *,
        fingerprint: str,
        doc_prefix: str | None,
        kv_dtype: torch.dtype,
        model_name: str,
        window: ContextWindow,
        capacity: int,
        kv_codec: KVCodec = NO_CODEC,
    ) -> None:
        self.store = store
        self.fingerprint = fingerprint
        #: The text every document is precomputed behind ("" for the BOS token alone).
        self.context = doc_prefix or ""
        self.window = window
        #: Computes, checks and opens the store entries of segment KV.
        self.segment_kv = SegmentKV(
            decoder,
            tokenizer,
            store,
            fingerprint=fingerprint,
            doc_prefix=doc_prefix,
            kv_dtype=kv_dtype,
            model_name=model_name,
            check_length=window.check_length,
            context_of=self.context_for,
            known=self.is_known,
            codec=kv_codec,
        )
        #: The documents found in prompt strings, shared with every engine over the same store
        #: and model, whatever their document context and KV codec (see
        #: `kvblend.documents.registry`): a document known is found, and its entry of this
        #: engine's codec computed when the store holds only another codec's.
        self.registry = DocumentRegistry(
            store, registry_log(fingerprint), capacity=capacity, stored=self.stored_documents
        )

    @classmethod
    def open(
        cls,
        decoder: ModelAdapter,
        tokenizer: Any,
        store: KVStore,
        *,
        fingerprint: str,
        model_name: str,
        doc_prefix: str | None,
        kv_dtype: torch.dtype | None = None,
        codec: str | KVCodec | None = None,
        capacity: int = DEFAULT_CAPACITY,
    ) -> DocumentLibrary:
        """Return the documents of the model ``decoder`` runs over ``store``, behind ``doc_prefix``.

        The window every document and prompt must fit is the model's; entries are stored in
        ``kv_dtype`` (default: the model's) with the KV ``codec`` (a name or a `KVCodec`; None:
        full precision); the registry keeps ``capacity`` documents.
        """
        window = ContextWindow(
            decoder.shape.max_positions, longest_token_chars(tokenizer), model_name
        )
        return cls(
            decoder,
            tokenizer,
            store,
            fingerprint=fingerprint,
            doc_prefix=doc_prefix,
            kv_dtype=kv_dtype or decoder.dtype,
            model_name=model_name,
            window=window,
            capacity=capacity,
            kv_codec=kv_codec(codec),
        )

    def stored_documents(self) -> Iterator[Mapping[str, str]]:
        """Yield the metadata of this model's entries in the store (to rebuild the registry)."""
        keys = getattr(self.store, "keys", None)
        try:
            listed = keys() if callable(keys) else []
        except NotImplementedError:
            listed = []  # a store that cannot list its entries: nothing to rebuild from
        for key in listed:
            try:
                metadata = self.store.metadata(key)
            except Exception as error:  # noqa: BLE001 - an unreadable entry names nothing
                logger.debug("skipping entry %s while rebuilding the registry: %s", key, error)
                continue
            if (
                metadata
                and metadata.get("fingerprint") == self.fingerprint
                and metadata.get("format") == KV_LAYOUT
            ):
                yield metadata

    def context_for(self, text: str) -> str:
        """Return the document context to read ``text``'s KV from.

        The library's own when the store holds the document behind it (or nowhere yet), else
        the context most recently recorded for it.
        """
        stored = self.registry.contexts(text)
        return self.context if not stored or self.context in stored else stored[-1]

    def is_known(self, text: str) -> bool:
        """Whether ``text`` is in the document registry (found when it occurs in a prompt)."""
        return text in self.registry

    def register(self, texts: Iterable[str]) -> None:
        """Make document texts known without computing anything."""
        items = [texts] if isinstance(texts, str) else check_texts(texts, "texts")
        self.registry.add(items, self.context)

    def precompute(
        self,
        texts: Iterable[str],
        *,
        progress: bool | None = None,
        force: bool = False,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        report: ProgressListener | None = None,
    ) -> list[str]:
        """Check every text, then compute and store the KV of those not stored; return the ids.

        Each text becomes known as its batch is stored. ``progress=None`` shows a progress bar
        (`PrecomputeBar`: tokens, documents, bytes written of the expected growth) on a terminal
        for four or more texts; ``report`` gets every `PrecomputeProgress` as well.
        """
        items = [texts] if isinstance(texts, str) else check_texts(texts, "texts")
        check_count(batch_tokens, "batch_tokens")
        for name, flag in (("force", force), ("progress", progress)):
            if not isinstance(flag, bool) and not (name == "progress" and flag is None):
                raise TypeError(f"{name} must be True or False, got {type(flag).__name__}")
        self.check_documents(items)  # every one fits, before anything is computed

        def done(stored: list[str]) -> None:
            self.registry.add(stored, self.context)

        with PrecomputeBar(
            disable=(len(items) < 4 if progress is None else not progress) or None
        ) as bar:

            def listen(state: PrecomputeProgress) -> None:
                if report is not None:
                    report(state)  # first: a line it prints comes before the bar opens
                bar(state)

            return self.segment_kv.ensure_many(
                items, force=force, batch_tokens=batch_tokens, done=done, progress=listen
            )

    def check_documents(self, texts: Sequence[str]) -> None:
        """Refuse the first text that is not a valid document or cannot fit the window.

        The character count is checked first (no tokenizing); only a text whose UTF-8 bytes
        (each token holds at least one) could overflow the window is tokenized to be sure. The
        error names the document: its index and the start of its text.
        """
        room = self.window.tokens - len(self.context.encode("utf-8")) - 16  # special tokens
        for index, text in enumerate(texts):
            what = f"document {index} ({short(text)})" if isinstance(text, str) else None
            if what is not None:
                self.window.check_chars(len(text), what)  # first: cheaper than reading the text
            try:
                Segment(text)  # validates
            except (TypeError, ValueError) as error:
                raise type(error)(f"document {index}: {error}") from None
            if self.window.tokens and len(text.encode("utf-8", "surrogatepass")) > room:
                beyond = tokens_beyond(self._tokenize, text, self.window.tokens)  # a prefix first
                if beyond is not None:
                    self.window.check_length(beyond[0], what, at_least=not beyond[1])
                layout = self.segment_kv.layout(text, self.context)
                self.window.check_length(len(layout.context_ids) + len(layout.ids), what)

    def _tokenize(self, text: str) -> list[int]:
        return list(self.segment_kv.tokenizer(text, add_special_tokens=False)["input_ids"])

    def segments_for(self, prompt: str, *, cache_prefix: bool = False) -> list[Segment]:
        """Cut a prompt string into segments: the known documents in it and the text between.

        ``cache_prefix``: the text before the first document is cached as a prefix.
        """
        if isinstance(prompt, str):
            self.window.check_chars(len(prompt))  # before reading, searching or tokenizing
        check_text(prompt, "the prompt")
        if not prompt:
            raise ValueError("the prompt is empty")
        matches = self.registry.find(prompt)
        pieces: list[Segment] = []
        cursor = 0
        for match in matches:
            if match.start > cursor:
                pieces.append(Segment(prompt[cursor : match.start], cache=False))
            pieces.append(Segment(prompt[match.start : match.end]))
            cursor = match.end
        if cursor < len(prompt):
            pieces.append(Segment(prompt[cursor:], cache=False))
        if cache_prefix and matches and not pieces[0].cache:
            pieces[0] = Segment(pieces[0].text, role="prefix")
        return pieces

    def near_miss(self, prompt: object, items: Sequence[Segment]) -> str | None:
        """Describe a known document whose start, not whole text, is in a prompt.

        A prompt string, or the text of a segment list outside its cached segments (the
        adapters cut the prompt strings they get into segments, `segments_for`). The registry
        finds a document by its first `ANCHOR_CHARS` characters and then its whole text; a
        prompt that holds those first characters outside the matched documents but not the
        whole text holds a truncated or rewritten copy, which is computed in full. None when
        there is no such start (a prompt without documents, such as a greeting):
        `DocumentRegistry.anchor_in`.
        """
        text = prompt if isinstance(prompt, str) else "".join(item.text for item in items)
        matched = [(piece.start, piece.end) for piece in cached_pieces(items)]
        found = self.registry.anchor_in(text, matched)
        if found is None:
            return None
        start, length = found
        return (
            f"a known document of {length} characters starts at character {start} "
            f"({snippet(text[start : start + 40], 44)}) but the prompt does not "
            "hold its whole text (truncated, rewritten or re-joined): computed in full"
        )

    def stored_spans(self, plan: PrefillPlan) -> dict[int, bool]:
        """Whether the store holds the KV of each cached span of ``plan`` (by its index)."""
        key = self.segment_kv.entry_key
        return {
            index: self.store.contains(key(span.context_ids, span.cached_ids))
            for index, span in enumerate(plan.spans)
        }
