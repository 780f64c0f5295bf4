"""Document files for ``kvblend precompute`` and ``ask``: which files, which fit, stored.

`list_files` finds the files of the paths given and `read_files` reads them, before the model
loads: inside a folder, hidden files and dot-folders are skipped (named in one line) and so is
every file that is not text; an empty, blank, undecodable or unreadable file is named, and a
file over `MAX_FILE_BYTES` is named without being read. Once the model is loaded,
`fitting_documents` skips a file longer than its context window (with the document context it
is precomputed behind) without tokenizing it whole: by its characters when no window could hold
them (a 10 MiB file costs nothing), else by tokenizing about a window of it; with ``--chunk``
it splits such a file at token boundaries into chunks whose exact token count, tokenized as
they are stored (behind the document context), fits the window; the chunks joined are the
file's text, character for character. `precompute_each` stores them; a file the engine refuses
for another reason is named and skipped too: one bad file never costs the rest of the batch.
Every skipped file is named on its own line and counted in `DocumentFiles.skipped`.
`not_kept` then says which documents the store did not keep (`kvblend precompute` fails naming
them, and names a chunked file that was not stored whole).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvblend.cli.report import PrecomputeTally
from kvblend.command_line import CLIError, printable

if TYPE_CHECKING:
    from kvblend.engine.engine import BlendEngine

logger = logging.getLogger("kvblend")

#: Suffixes of the files read inside a folder (a file named on the command line is always read).
TEXT_SUFFIXES = (".md", ".rst", ".text", ".txt")
#: Characters of the pieces a text is tokenized in when ``--chunk`` splits it.
CHUNK_BLOCK_CHARS = 1 << 18
#: Bytes of the largest file read as a document (a larger one is named and skipped unread).
MAX_FILE_BYTES = 256 << 20
#: Tokens of a precompute batch on a CPU: about one chunk, so that each is stored as soon as it
#: is computed (on a CPU a batch of one 512-token document runs at the documents/s of larger
#: ones, benchmarks/cpu.md "Document ingestion"; a GPU keeps the engine's larger batches).
CPU_BATCH_TOKENS = 512


class DocumentFiles:
    """The files of a command's paths, and the ones skipped (each named on its own line)."""

    def __init__(self) -> None:
        self.skipped: list[str] = []
        #: (name, segment id) of every document stored, chunks named ``FILE [chunk N]``.
        self.stored: list[tuple[str, str]] = []
        #: Files split with ``--chunk``: name -> number of chunks.
        self.chunked: dict[str, int] = {}

    def skip(self, name: str, reason: str) -> None:
        """Name a skipped file (or folder) and why, in one line."""
        logger.warning(printable(f"skipping {name}: {reason}"))
        self.skipped.append(name)


def _walk(folder: Path, files: DocumentFiles) -> Iterator[Path]:
    """Yield the text files under ``folder``, sorted; name hidden entries and other files."""
    hidden: list[str] = []
    for root, folders, names in os.walk(folder):
        here = Path(root)
        hidden += [str(here / name) + "/" for name in folders if name.startswith(".")]
        folders[:] = sorted(name for name in folders if not name.startswith("."))
        for name in sorted(names):
            path = here / name
            if name.startswith("."):
                hidden.append(str(path))
            elif path.suffix.lower() not in TEXT_SUFFIXES:
                files.skip(str(path), f"not a text file ({', '.join(TEXT_SUFFIXES)})")
            else:
                yield path
    if hidden:
        logger.warning(printable(f"skipping hidden files and folders: {', '.join(hidden)}"))
        files.skipped += hidden


def list_files(paths: Sequence[str], files: DocumentFiles) -> list[Path]:
    """Return the document files of ``paths`` (files or folders); name the empty and skipped.

    A path that does not exist is a `CLIError`, and so is finding no file to read.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found += _walk(path, files)
        elif path.is_file():
            found.append(path)
        else:
            raise CLIError(f"no such file or folder: {raw}")
    listed = []
    for path in found:
        try:
            empty = path.stat().st_size == 0
        except OSError as error:
            files.skip(str(path), error.strerror or str(error))
            continue
        if empty:
            files.skip(str(path), "empty file")
        else:
            listed.append(path)
    if not listed:
        raise CLIError(f"no documents found (text files: {', '.join(TEXT_SUFFIXES)})")
    return listed


def read_files(paths: Sequence[Path], files: DocumentFiles) -> list[tuple[str, str]]:
    """Read each file as UTF-8 ``(name, text)``; name the unreadable, blank and too large."""
    named = []
    for path in paths:
        name = str(path)
        try:
            size = path.stat().st_size
            if size > MAX_FILE_BYTES:
                files.skip(
                    name,
                    f"{size / 2**20:,.0f} MiB, larger than a document file may be "
                    f"({MAX_FILE_BYTES >> 20} MiB)",
                )
                continue
            text = path.read_text("utf-8").strip()
        except UnicodeDecodeError as error:
            files.skip(name, f"not UTF-8 text ({error.reason} at byte {error.start})")
            continue
        except OSError as error:
            files.skip(name, error.strerror or str(error))
            continue
        if text:
            named.append((name, text))
        else:
            files.skip(name, "blank file (only whitespace)")
    if not named:
        raise CLIError("no documents found (named above)")
    return named


def _too_long(engine: BlendEngine, chars: int) -> str | None:
    """Why a text of ``chars`` characters cannot fit the window in any case (None: it may)."""
    window = engine.library.window
    if not window.tokens or chars <= window.tokens * window.max_token_chars:
        return None
    return (
        f"{chars:,} characters, longer than {engine.name}'s context window of {window.tokens} "
        f"tokens can hold (at most {window.max_token_chars} characters a token); --chunk splits it"
    )


def document_room(engine: BlendEngine) -> int:
    """Tokens a document may have: the context window less its document context (and BOS)."""
    context = len(engine.encode(engine.doc_prefix)) if engine.doc_prefix else 1
    return max(1, engine.context_window - context - 1)


def _blocks(text: str, size: int) -> Iterator[str]:
    """``text`` in pieces of about ``size`` characters, each cut before a whitespace."""
    start = 0
    while len(text) - start > size:
        cut = max(
            text.rfind(" ", start + size // 2, start + size),
            text.rfind("\n", start + size // 2, start + size),
        )
        cut = cut if cut > start else start + size
        yield text[start:cut]
        start = cut
    yield text[start:]


def document_tokens(engine: BlendEngine, text: str) -> int:
    """Tokens of ``text`` as the engine stores it: behind its document context, with it."""
    library = engine.library
    layout = library.segment_kv.layout(text, library.context)
    return len(layout.context_ids) + len(layout.ids)


def chunks(engine: BlendEngine, text: str, room: int) -> list[str]:
    """Split ``text`` at token boundaries into pieces that fit the context window as stored.

    Cut every ``room`` tokens of the text's own tokenization, then each piece is tokenized as
    it will be stored (`document_tokens`: behind the document context, which may join or split
    tokens at its edges differently) and a piece over the window is cut again, shorter. Nothing
    is stripped: the pieces joined are ``text``. The text is tokenized in blocks of
    `CHUNK_BLOCK_CHARS` characters, so a file of megabytes never becomes one tokenizer call.
    """
    limit = engine.context_window or room
    pieces: list[str] = []
    for block in _blocks(text, CHUNK_BLOCK_CHARS):
        pieces += _fitting_pieces(engine, block, room, limit)
    return pieces


def _fitting_pieces(engine: BlendEngine, text: str, room: int, limit: int) -> list[str]:
    """``text`` cut every ``room`` tokens; a piece over ``limit`` as stored is cut shorter."""
    encoded = engine.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    cuts = [0, *(offsets[first][0] for first in range(room, len(offsets), room)), len(text)]
    fitting = []
    for start, end in zip(cuts, cuts[1:], strict=False):
        piece = text[start:end]
        if not piece:
            continue  # two cuts inside one character's tokens
        excess = document_tokens(engine, piece) - limit
        if excess > 0 and room > 1:
            fitting += _fitting_pieces(engine, piece, max(1, room - excess - 8), limit)
        else:
            fitting.append(piece)
    return fitting


def fitting_documents(
    engine: BlendEngine,
    named: Sequence[tuple[str, str]],
    *,
    chunk: bool,
    files: DocumentFiles | None = None,
    chunk_tokens: int | None = None,
    longest: int | None = None,
) -> list[tuple[str, str]]:
    """Return the ``(name, text)`` documents that fit; name each other file in one line.

    A text no context window could hold (by its characters) is skipped untokenized; another is
    tokenized only as far as it takes to know it does not fit (about a context window of it,
    `kvblend.validation.tokens_beyond`), unless ``chunk`` splits it into chunks of about
    ``chunk_tokens`` tokens (None: as long as the window allows). ``longest``: with ``chunk``,
    a text of more tokens than this is split too, though the window could hold it.
    """
    from kvblend.validation import tokens_beyond

    files = files or DocumentFiles()
    room = document_room(engine)
    if chunk and longest is not None:
        room = max(1, min(room, longest))
    size = room if chunk_tokens is None else max(1, min(room, chunk_tokens))
    fitting = []
    for name, text in named:
        too_long = None if chunk else _too_long(engine, len(text))
        if too_long is not None:
            files.skip(name, too_long)
            continue
        beyond = tokens_beyond(engine.tokenize, text, room)
        if beyond is None:
            fitting.append((name, text))
            continue
        tokens, exact = beyond
        count = f"{tokens:,} tokens" if exact else f"more than {room} tokens"
        if chunk:
            pieces = chunks(engine, text, size)
            logger.warning(printable(f"{name}: {count}, split into {len(pieces)} chunks"))
            fitting += [(chunk_name(name, i), piece) for i, piece in enumerate(pieces)]
            files.chunked[name] = len(pieces)
        else:
            files.skip(
                name,
                f"{count}, longer than {engine.name}'s context window leaves a document "
                f"({room}); --chunk splits it",
            )
    return fitting


def prompt_tokens(engine: BlendEngine, text: str) -> int:
    """Tokens document ``text`` takes in a prompt (as stored, without its document context)."""
    library = engine.library
    return len(library.segment_kv.layout(text, library.context).ids)


def chunk_name(name: str, index: int) -> str:
    """Return the name of chunk ``index`` (from 0) of file ``name``: ``name [chunk N]``."""
    return f"{name} [chunk {index + 1}]"


def precompute_each(
    engine: BlendEngine,
    documents: Sequence[tuple[str, str]],
    files: DocumentFiles | None = None,
    *,
    tally: PrecomputeTally | None = None,
    progress: bool = False,
) -> int:
    """Precompute ``documents`` in batches; on a refusal, one by one, naming each failure.

    Returns how many documents are stored; `DocumentFiles.stored` lists them with their ids.
    ``tally`` adds up what each precompute call computed and found stored; ``progress``: a
    progress bar on a terminal (`kvblend.documents.progress.PrecomputeBar`). On a CPU the
    batches are of `CPU_BATCH_TOKENS`, so the bar's bytes move with each document.
    """
    from kvblend.documents.precompute import DEFAULT_BATCH_TOKENS

    files = files if files is not None else DocumentFiles()
    tally = tally if tally is not None else PrecomputeTally(quiet=True)
    if not documents:
        return 0
    on_cpu = engine.decoder.device.type == "cpu"
    batch_tokens = CPU_BATCH_TOKENS if on_cpu else DEFAULT_BATCH_TOKENS

    def precompute(texts: list[str]) -> list[str]:
        try:
            return engine.library.precompute(
                texts, progress=progress, report=tally, batch_tokens=batch_tokens
            )
        finally:
            tally.finish_call()

    try:
        ids = precompute([text for _, text in documents])
    except ValueError:
        pass  # find the file at fault; the others are kept
    else:
        files.stored += [(name, id_) for (name, _), id_ in zip(documents, ids, strict=True)]
        return len(ids)
    stored = 0
    for name, text in documents:
        try:
            (id_,) = precompute([text])
        except ValueError as error:
            files.skip(name, " ".join(str(error).split()))
        else:
            files.stored.append((name, id_))
            stored += 1
    return stored


def not_kept(store: Any, stored: Sequence[tuple[str, str]]) -> list[str]:  # noqa: ANN401
    """Names of the ``(name, segment id)`` documents no lasting tier of ``store`` holds.

    A lasting tier is the disk tier and a remote (Redis) one; a document counts as kept when
    one of them holds an entry of it this process can read (its header verified, under this
    process's store key). A store without such tiers (``--memory-only``) keeps nothing by
    design: nothing is reported.
    """
    from kvblend.store import StoreError

    tiers = [
        tier
        for tier in (getattr(store, "disk", None), getattr(store, "remote", None))
        if tier is not None
    ]
    if not tiers:
        return []
    missing = []
    for name, key in stored:
        for tier in tiers:
            try:
                if tier.metadata(key) is not None:
                    break
            except StoreError:
                continue
        else:
            missing.append(name)
    return missing


def unstored_files(files: DocumentFiles, missing: Sequence[str]) -> str | None:
    """One line naming what was not stored: each chunked file not stored whole, other files."""
    lost = set(missing) | set(files.skipped)
    parts = []
    for name, count in files.chunked.items():
        gone = [index + 1 for index in range(count) if chunk_name(name, index) in lost]
        if gone:
            listed = ", ".join(str(number) for number in gone[:10])
            more = f" and {len(gone) - 10} more" if len(gone) > 10 else ""
            parts.append(f"{name} (chunks {listed}{more} of {count})")
    chunks_of = {
        chunk_name(name, index) for name, count in files.chunked.items() for index in range(count)
    }
    parts += [name for name in missing if name not in chunks_of]
    return ", ".join(parts) if parts else None
