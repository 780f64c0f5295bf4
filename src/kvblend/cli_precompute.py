"""``kvblend precompute`` over folders: every file that fits is stored, the others are named.

A file longer than the model's context window (with the document context it is precomputed
behind) is skipped with one line naming it, or, with ``--chunk``, split at token boundaries
into documents that fit. A file the engine refuses for another reason is named and skipped
too: one bad file never costs the rest of the batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .cli_args import printable

if TYPE_CHECKING:
    from .engine import BlendEngine

logger = logging.getLogger("kvblend")


def document_room(engine: BlendEngine) -> int:
    """Tokens a document may have: the context window less its document context (and BOS)."""
    context = len(engine.encode(engine.doc_prefix)) if engine.doc_prefix else 1
    return max(1, engine.context_window - context - 1)


def chunks(engine: BlendEngine, text: str, room: int) -> list[str]:
    """Split ``text`` at token boundaries into pieces of at most ``room`` tokens."""
    encoded = engine.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    pieces, start = [], 0
    for first in range(room, len(offsets), room):
        cut = offsets[first][0]
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return [piece.strip() for piece in pieces if piece.strip()]


def fitting_documents(
    engine: BlendEngine, named: Sequence[tuple[str, str]], *, chunk: bool
) -> list[tuple[str, str]]:
    """Return the ``(name, text)`` documents that fit; log one line for each other file."""
    room = document_room(engine)
    fitting = []
    for name, text in named:
        tokens = len(engine.tokenize(text))
        if tokens <= room:
            fitting.append((name, text))
        elif chunk:
            pieces = chunks(engine, text, room)
            logger.warning(printable(f"{name}: {tokens} tokens, split into {len(pieces)} chunks"))
            fitting += [(f"{name} [chunk {i + 1}]", piece) for i, piece in enumerate(pieces)]
        else:
            logger.warning(
                printable(
                    f"skipping {name}: {tokens} tokens, longer than {engine.name}'s context "
                    f"window leaves a document ({room}); --chunk splits it"
                )
            )
    return fitting


def precompute_each(engine: BlendEngine, documents: Sequence[tuple[str, str]]) -> int:
    """Precompute ``documents`` in batches; on a refusal, one by one, naming each failure.

    Returns how many documents are stored.
    """
    if not documents:
        return 0
    try:
        return len(engine.precompute([text for _, text in documents], progress=True))
    except ValueError:
        pass  # find the file at fault; the others are kept
    stored = 0
    for name, text in documents:
        try:
            engine.precompute([text], progress=False)
        except ValueError as error:
            logger.warning(printable(f"skipping {name}: {' '.join(str(error).split())}"))
        else:
            stored += 1
    return stored
