"""`DocumentsMixin`: `BlendEngine`'s document methods, answered by its `DocumentLibrary`.

``segment_id``, ``precompute``, ``register``, ``is_known`` and ``segments_for`` are part of
`BlendEngine`'s API; each checks its input and hands over to the engine's ``library``
(`kvblend.documents.library`), which holds the documents' KV in the store and the registry that
finds them in prompts. A mixin, as `GenerationMixin` puts ``generate`` on the engine: these
methods use only the ``library`` `BlendEngine` builds.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvblend.documents.library import DocumentLibrary
from kvblend.documents.precompute import DEFAULT_BATCH_TOKENS
from kvblend.prompt.segments import PromptLike, Segment, check_segments
from kvblend.validation import check_text


class DocumentsMixin:
    """The documents of a `BlendEngine`: their KV precomputed and found in prompts."""

    #: This engine's documents: their KV in the store and the registry finding them.
    library: DocumentLibrary

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
