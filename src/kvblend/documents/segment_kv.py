"""Segment KV in the store: computing, checking and opening the entries a prefill reads.

`SegmentKV` is the engine's only path to stored KV. It knows how a document is tokenized for
its cache (behind the document context, memoized), computes an entry with the engine's own
layer loop (`kvblend.documents.precompute`) and writes it, checks that an entry reads back, and
opens an entry (`kvblend.documents.blend_plan` opens those a prefill plan needs). A store that
fails never fails an answer: a missing or unreadable entry is computed, and one that fails while
it is being read (a damaged tensor, a remote tier gone mid-prompt) is recomputed in place
(`StoredRows`, `recompute`).

An entry is one tensor, ``kv``: every layer's un-rotated keys and values of the document,
``[layers, 2, kv_heads, tokens, head_dim]`` (keys, then values), laid out as the prompt buffer
of the blend loop (`kvblend.blend.kv_buffer.PromptKV`) holds them, so a document's rows of a
group of layers are placed with one copy. What a store hands out is read in place:
`StoredRows` gives views into it, and the blend loop only ever copies out of them, never writes
into them.

With a quantized codec (`kvblend.blend.kv_codec`: ``int8``, ``k8v4``, ``int4``), an entry
holds the codec's codes and scales instead (two tensors in the one blob), its segment id is
made with the codec's fingerprint (a reader of another codec never finds it) and its metadata
names the codec; full-precision entries (``none``, the default) keep the ids and the format
they always had.

Nothing read is trusted: every entry is opened with the tensors the model needs (``kv``,
``kv_dtype``, the shape above with the document's token count; or the codec's codes and
scales) and finite values, which the store checks in the same pass as the checksum
(`kvblend.store.base.EntrySpec`); an entry that differs is corrupt: dropped, counted and
recomputed, never used. `StoredRows` checks the shape again as it is used, so a store that
ignores the expectation still never feeds a wrong-shaped tensor to the model.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from kvblend.blend.adapter import ModelAdapter
from kvblend.blend.kv_codec import NO_CODEC, KVCodec
from kvblend.documents.precompute import DEFAULT_BATCH_TOKENS, document_kv, length_batches
from kvblend.documents.progress import PrecomputeProgress, ProgressListener
from kvblend.documents.registry_records import document_metadata
from kvblend.prompt.segments import KV_LAYOUT, segment_key
from kvblend.prompt.tokens import DocumentLayout, document_layout

if TYPE_CHECKING:
    from kvblend.store.base import EntrySpec, KVStore

logger = logging.getLogger(__name__)

__all__ = ["SegmentKV"]

_LAYOUT_CACHE = 4096  # tokenized documents kept, by text


class SegmentKV:
    """Compute, store, check and open segment KV for one model, store and document context.

    The one maker of segment ids (`entry_key`): the model's fingerprint, mixed with a quantized
    codec's, and the document's token ids behind its context.
    """

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
        check_length: Callable[[int], None],
        context_of: Callable[[str], str] | None = None,
        known: Callable[[str], bool] | None = None,
        codec: KVCodec = NO_CODEC,
    ) -> None:
        self.decoder = decoder
        self.tokenizer = tokenizer
        self.store = store
        #: How entries are stored: full precision (``none``) or a quantized codec.
        self.codec = codec
        #: The model's fingerprint: what entries' metadata names, and (mixed with a quantized
        #: codec's name) what their segment ids are made with (`entry_key`).
        self.fingerprint = fingerprint
        self.doc_prefix = doc_prefix
        self.kv_dtype = kv_dtype
        self.model_name = model_name
        self._check_length = check_length
        #: Which document context a document's KV is read from (default: `doc_prefix`).
        self.context_of = context_of
        #: Whether a text is a known document (registered): only those entries name it.
        self.known = known
        self._layouts: OrderedDict[tuple[str, str], DocumentLayout] = OrderedDict()
        #: segment id -> (text, context) of each document whose layout is memoized, so an
        #: entry computed during a prefill or recomputed after a damaged read names its
        #: document as `ensure_many`'s entries do (the registry is rebuilt from those names)
        self._documents: dict[str, tuple[str, str]] = {}
        self._lock = threading.Lock()
        #: entries found damaged or not fitting the model since this object was built
        self.dropped = 0

    def entry_shape(self, tokens: int) -> tuple[torch.dtype, tuple[int, ...]]:
        """Return the dtype and shape of the K/V of a ``tokens``-token document's entry.

        The stored tensor itself for ``none``; what the codes decode to for a quantized codec.
        """
        shape = self.decoder.shape
        return self.kv_dtype, (shape.num_layers, 2, shape.num_kv_heads, tokens, shape.head_dim)

    def stored_tensors(self, tokens: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """Name -> (dtype, shape) of every tensor a ``tokens``-token document's entry holds."""
        return self.codec.stored_tensors(*self.entry_shape(tokens))

    def expectation(self, tokens: int) -> EntrySpec:
        """Return the `EntrySpec` a ``tokens``-token document's entry is checked against."""
        from kvblend.store.base import (
            EntrySpec,  # the store's contract type; no store is built here
        )

        return EntrySpec(self.stored_tensors(tokens))

    def open_entry(
        self, key: str, tokens: int, device: torch.device | None = None
    ) -> Mapping[str, torch.Tensor] | None:
        """Open ``key``'s entry, checked against a ``tokens``-token document (None: a miss)."""
        return self.store.get(key, device=device, expect=self.expectation(tokens))

    def layout(self, text: str, context: str | None = None) -> DocumentLayout:
        """How ``text`` is tokenized for its cache: behind its document context (memoized).

        ``context=None``: the one ``context_of(text)`` names (the store may hold the document
        behind another engine's context), else this engine's `doc_prefix`.
        """
        if context is None:
            context = self.context_of(text) if self.context_of else (self.doc_prefix or "")
        memo = (context, text)
        with self._lock:
            found = self._layouts.get(memo)
            if found is not None:
                self._layouts.move_to_end(memo)
                return found
        layout = document_layout(self.tokenizer, context, text)
        key = self.entry_key(layout.context_ids, layout.ids)
        with self._lock:
            self._layouts[memo] = layout
            self._documents[key] = (text, context)
            if len(self._layouts) > _LAYOUT_CACHE:
                (old_context, old_text), old = self._layouts.popitem(last=False)
                old_key = self.entry_key(old.context_ids, old.ids)
                if self._documents.get(old_key) == (old_text, old_context):
                    del self._documents[old_key]
        return layout

    def described(self, key: str) -> dict[str, str]:
        """Entry metadata naming the known document stored under ``key`` (tokenized here).

        Empty for a segment that is no known document (a prompt head, a segment passed in a
        list and never registered) or one whose layout is no longer memoized.
        """
        with self._lock:
            found = self._documents.get(key)
        if found is None or (self.known is not None and not self.known(found[0])):
            return {}
        return document_metadata(*found)

    def key(self, text: str, context: str | None = None) -> str:
        """Return the segment id of a document text (``context`` as in `layout`)."""
        layout = self.layout(text, context)
        return self.entry_key(layout.context_ids, layout.ids)

    def entry_key(self, context_ids: Sequence[int], token_ids: Sequence[int]) -> str:
        """Return the segment id of ``token_ids``' KV computed behind ``context_ids``.

        Every key of this model's (and codec's) entries is made here: a planned span's
        (``span.context_ids``, ``span.cached_ids``), a document's layout.
        """
        return segment_key(self.codec.fingerprint(self.fingerprint), context_ids, token_ids)

    def over(self, store: KVStore) -> SegmentKV:
        """Return the same model's segment KV over another ``store``, behind no context.

        Its entries are keyed, encoded and checked as this one's (the vLLM connector's
        calibration blends synthetic entries over a memory store so).
        """
        return SegmentKV(
            self.decoder,
            self.tokenizer,
            store,
            fingerprint=self.fingerprint,
            doc_prefix=None,
            kv_dtype=self.kv_dtype,
            model_name=self.model_name,
            check_length=lambda tokens: None,
            codec=self.codec,
        )

    def ensure_many(
        self,
        texts: Sequence[str],
        *,
        force: bool = False,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        done: Callable[[list[str]], None] | None = None,
        progress: ProgressListener | None = None,
    ) -> list[str]:
        """Store the KV of each text unless an intact entry is there; return their segment ids.

        The missing entries (``force``: all) are computed in length-sorted batches;
        ``batch_tokens`` bounds ``documents x longest`` of a batch (`length_batches`).
        ``done(texts)`` is called with the texts already stored, then after each batch.
        ``progress`` gets a `PrecomputeProgress` before anything is computed, after each layer
        of a batch's pass and after each batch is stored.
        Returns the segment ids, in the order of ``texts``. Entries are computed behind this
        engine's own `doc_prefix` and carry what the registry needs to find them again
        (`kvblend.documents.registry_records.document_metadata`).
        """
        context = self.doc_prefix or ""
        layouts = [self.layout(text, context) for text in texts]
        keys = [self.entry_key(lay.context_ids, lay.ids) for lay in layouts]
        missing = self._missing(keys, layouts, force)  # segment id -> index of its first text
        if done is not None:
            done(_texts_of(texts, keys, set(keys) - set(missing)))
        todo = [(key, layouts[index]) for key, index in missing.items()]
        described = {key: document_metadata(texts[i], context) for key, i in missing.items()}
        lengths = [len(lay.context_ids) + len(lay.ids) for _, lay in todo]
        for length in lengths:  # a text too long fails the call before anything is computed
            self._check_length(length)
        report = _Reporter(progress, len(set(keys)), len(set(keys)) - len(todo), lengths)
        report.expected(sum(self.entry_bytes(len(lay.ids)) for _, lay in todo))
        layers = self.decoder.shape.num_layers
        for batch in length_batches(lengths, batch_tokens):
            tokens = sum(lengths[index] for index in batch)
            entries = [todo[index] for index in batch]
            written = self.compute_batch(entries, described, pause=report.layers(tokens, layers))
            report.stored(len(batch), tokens, written)
            if done is not None:
                done(_texts_of(texts, keys, {key for key, _ in entries}))
        return keys

    def _missing(
        self, keys: list[str], layouts: list[DocumentLayout], force: bool
    ) -> dict[str, int]:
        """Segment id -> index of its first text, of each entry to compute (``force``: all)."""
        missing: dict[str, int] = {}
        for index, key in enumerate(keys):
            tokens = len(layouts[index].ids)
            if key not in missing and (force or not self.intact(key, tokens)):
                missing[key] = index
        return missing

    def entry_bytes(self, tokens: int) -> int:
        """Bytes of the tensors of a ``tokens``-token document's entry (its header aside)."""
        return sum(
            math.prod(shape) * dtype.itemsize
            for dtype, shape in self.stored_tensors(tokens).values()
        )

    def intact(self, key: str, tokens: int | None = None) -> bool:
        """Whether the store holds ``key`` and every tensor reads back fitting the model.

        ``tokens`` is the document's token count (None: the count the entry's own metadata
        gives). An entry that is damaged, of another shape or dtype, or not finite is dropped.
        """
        try:
            if tokens is None:
                tokens = int((self.store.metadata(key) or {}).get("tokens", -1))
            entry = self.open_entry(key, tokens)
            if entry is None:
                return False
            self._check_read(entry, tokens)
            return True
        except Exception as error:  # noqa: BLE001 - any unreadable entry is recomputed
            logger.warning("dropping unreadable KV entry %s: %s", key, error)
            self.drop(key)
            return False

    def _check_read(self, entry: Mapping[str, torch.Tensor], tokens: int) -> None:
        """Read every tensor of ``entry``; raise ValueError if one does not fit the model."""
        fits = self.stored_tensors(tokens)
        if set(entry) != set(fits):
            raise ValueError(f"holds tensors {sorted(entry)[:3]}, the model needs {sorted(fits)}")
        for name in entry:
            tensor = entry[name]
            if (tensor.dtype, tuple(tensor.shape)) != fits[name]:
                raise ValueError(f"tensor {name!r} is {tensor.dtype} {list(tensor.shape)}")
            if _non_finite(tensor):
                raise ValueError(f"tensor {name!r} holds NaN or infinity")

    def drop(self, key: str) -> None:
        """Delete ``key`` from the store, if the store can, and count it as dropped."""
        with self._lock:
            self.dropped += 1
        try:
            self.store.delete(key)
        except Exception as error:  # noqa: BLE001 - recomputing overwrites it anyway
            logger.debug("could not delete KV entry %s: %s", key, error)

    def compute(
        self, key: str, context: list[int], token_ids: list[int]
    ) -> dict[str, torch.Tensor]:
        """KV of ``token_ids`` computed behind ``context``; stored under ``key`` and returned.

        The entry names its document (`described`) when ``key`` is a document tokenized here.
        """
        self._check_length(len(context) + len(token_ids))
        kv = document_kv(self.decoder, [context + token_ids], [len(context)], self.kv_dtype)
        tensors = self.codec.encode(kv[0])
        self._put(key, tensors, len(context), len(token_ids))
        return tensors

    def compute_batch(
        self,
        entries: Sequence[tuple[str, DocumentLayout]],
        described: Mapping[str, Mapping[str, str]] | None = None,
        pause: Callable[[], None] | None = None,
    ) -> int:
        """Compute the KV of several documents in one batched pass of the loop and store each.

        ``entries`` are (segment id, layout) pairs; the stored entries are those `compute`
        would store (`kvblend.documents.precompute` says why the batched rows are exact).
        ``described``: metadata to store with each segment id's entry; ``pause``: called
        before each layer of the pass. Returns the bytes of the tensors written.
        """
        for _, layout in entries:
            self._check_length(len(layout.context_ids) + len(layout.ids))
        sequences = [layout.context_ids + layout.ids for _, layout in entries]
        starts = [len(layout.context_ids) for _, layout in entries]
        kvs = document_kv(self.decoder, sequences, starts, self.kv_dtype, pause=pause)
        written = 0
        for (key, layout), kv, start in zip(entries, kvs, starts, strict=True):
            tensors = self.codec.encode(kv)
            self._put(key, tensors, start, len(layout.ids), (described or {}).get(key))
            written += sum(tensor.nbytes for tensor in tensors.values())
        return written

    def _put(
        self,
        key: str,
        tensors: dict[str, torch.Tensor],
        context: int,
        tokens: int,
        described: Mapping[str, str] | None = None,
    ) -> None:
        if described is None:
            described = self.described(key)
        metadata = {
            **described,
            "format": KV_LAYOUT,
            "model": self.model_name,
            "fingerprint": self.fingerprint,
            "layers": str(self.decoder.shape.num_layers),
            "tokens": str(tokens),
            "context_tokens": str(context),
        }
        if self.codec.quantized:
            metadata["codec"] = self.codec.name
        try:
            self.store.put(key, tensors, metadata)
        except Exception as error:  # noqa: BLE001 - a failing store must not fail the answer
            logger.warning("could not store segment %s: %s", key, error)

    def recompute(
        self, key: str, context: list[int], token_ids: list[int]
    ) -> dict[str, torch.Tensor]:
        """Replace an entry that failed while being read: counted, computed and stored again.

        A corrupt entry was already dropped by the store; storing the new one overwrites
        whatever is left, so other readers never see the key missing meanwhile.
        """
        with self._lock:
            self.dropped += 1
        return self.compute(key, context, token_ids)


def _texts_of(texts: Sequence[str], keys: Sequence[str], chosen: set[str]) -> list[str]:
    """Return the texts (in order, repeats kept) whose segment id is one of ``chosen``."""
    return [text for text, key in zip(texts, keys, strict=True) if key in chosen]


def _non_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds NaN or infinity: one sum (they propagate), exact if it overflows."""
    if tensor.is_floating_point() and tensor.dtype.itemsize == 1:  # float8: no sum kernel
        tensor = tensor.to(torch.float16)
    if not tensor.is_floating_point() or math.isfinite(float(tensor.sum())):
        return False
    return not bool(torch.isfinite(tensor).all())


class _Reporter:
    """Builds `ensure_many`'s `PrecomputeProgress` reports; does nothing without a listener."""

    def __init__(
        self, listener: ProgressListener | None, documents: int, stored: int, lengths: list[int]
    ) -> None:
        self.listener = listener
        #: Tokens of the batches stored so far (``tokens_done`` once a batch is stored).
        self.stored_tokens = 0
        self.state = PrecomputeProgress(
            documents=documents,
            already_stored=stored,
            computed=0,
            tokens=sum(lengths),
            tokens_done=0,
            bytes_written=0,
            bytes_expected=0,
        )

    def _send(self, **changes: int) -> None:
        self.state = replace(self.state, **changes)
        if self.listener is not None:
            self.listener(self.state)

    def expected(self, total: int) -> None:
        """Send the first report: what is stored, what is to compute, the store's growth."""
        self._send(bytes_expected=total)

    def layers(self, tokens: int, layers: int) -> Callable[[], None] | None:
        """Return a pause hook for a batch of ``tokens`` that reports its finished layers."""
        if self.listener is None:
            return None
        calls = 0

        def layer_starts() -> None:
            nonlocal calls
            finished = min(calls, layers - 1)  # before layer l, l layers are done
            calls += 1
            if finished:
                self._send(tokens_done=self.stored_tokens + tokens * finished // layers)

        return layer_starts

    def stored(self, documents: int, tokens: int, written: int) -> None:
        """Report a batch of ``documents`` (``tokens``) stored, its tensors ``written`` bytes."""
        self.stored_tokens += tokens
        self._send(
            computed=self.state.computed + documents,
            tokens_done=self.stored_tokens,
            bytes_written=self.state.bytes_written + written,
        )
