"""A command that writes the store keeps what it computes or fails saying what it did not keep.

``kvblend precompute`` over a folder that cannot be used (a file, a read-only folder) fails in
one line before the model loads, instead of computing into memory and keeping nothing; a
document the store did not keep fails the command naming it. ``--chunk`` cuts a long file into
chunks whose exact token count, tokenized as they are stored (behind the document context),
fits the window: every chunk of a 200K-character file is stored, and the chunks joined are the
file's text. The model is a tiny random Llama over SmolLM2's own tokenizer (a real BPE: a chunk
stripped of its leading space tokenizes into more tokens, which is how chunks used to overflow).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from conftest import byte_tokenizer, smollm2_tiny_llama, tiny_model
from kvblend import BlendEngine
from kvblend.cli.args import DEFAULT_CHUNK_TOKENS
from kvblend.cli.main import main
from kvblend.cli.precompute import chunks, document_room, document_tokens
from kvblend.store import DiskKVStore, StoreError
from read_only_folder import read_only_folder


def _smollm2_engine(store: object) -> BlendEngine:
    """A tiny random Llama over the bundled SmolLM2's own tokenizer (it stores ~50K tokens of
    KV here), over `store`."""
    model, tokenizer = smollm2_tiny_llama()
    return BlendEngine(model, tokenizer, store=store)


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[BlendEngine]:
    """The CLI's model loads give a tiny engine over the store the CLI built; one per load."""
    engines: list[BlendEngine] = []

    def from_pretrained(cls, model=None, *, store, **kwargs):  # noqa: ANN001, ANN202
        engines.append(BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store))
        return engines[-1]

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(from_pretrained))
    return engines


def _one_line(err: str, message: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err and lines[-1].startswith("kvblend: error: "), err
    assert message in lines[-1], err


@pytest.mark.parametrize("command", ["precompute", "ask", "demo"])
def test_a_store_folder_that_is_a_file_fails_before_the_model_loads(
    loads: list[BlendEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    doc = tmp_path / "marta.txt"
    doc.write_text("Marta Quill keeps bees in Lisbon.")
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    argv = {"precompute": [str(doc)], "ask": ["Where?", "--docs", str(doc)], "demo": []}[command]
    code = main([command, *argv, "--store-dir", str(not_a_folder)])
    err = capsys.readouterr().err
    assert code == 2 and loads == []
    _one_line(err, f"cannot open the KV store in folder {not_a_folder}")
    assert "--memory-only keeps KV in memory" in err
    if command == "precompute":  # said on purpose, memory only works
        assert main([command, *argv, "--memory-only"]) == 0


def test_precompute_fails_on_a_read_only_folder_and_ask_reads_it(
    loads: list[BlendEngine], tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog
) -> None:
    doc = tmp_path / "marta.txt"
    doc.write_text("Marta Quill keeps bees in Lisbon.")
    folder = tmp_path / "kv"
    assert main(["precompute", str(doc), "--store-dir", str(folder)]) == 0
    with read_only_folder(folder) as view:
        (tmp_path / "tomas.txt").write_text("Tomas Elm makes violins in Cremona.")
        code = main(["precompute", str(tmp_path / "tomas.txt"), "--store-dir", str(view)])
        _one_line(capsys.readouterr().err, "is read-only: nothing precomputed could be kept")
        assert code == 2 and len(loads) == 1
        with caplog.at_level(logging.WARNING, logger="kvblend"):
            argv = ["ask", "Where?", "--docs", str(doc), "--store-dir", str(view)]
            assert main([*argv, "--max-new-tokens", "1"]) == 0
        assert "read-only: what is computed here is not kept" in caplog.text


def test_precompute_names_every_document_the_store_did_not_keep(
    loads: list[BlendEngine],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "marta.txt").write_text("Marta Quill keeps bees in Lisbon.")
    tomas = "Tomas Elm makes violins in Cremona, a town in the north of Italy."
    (docs / "tomas.txt").write_text(tomas)
    put = DiskKVStore.put

    def full_disk(self, key, tensors, metadata=None):  # noqa: ANN001, ANN202
        if (metadata or {}).get("document.chars") == str(len(tomas)):
            raise StoreError("cannot write entry: [Errno 28] No space left on device")
        return put(self, key, tensors, metadata)

    monkeypatch.setattr(DiskKVStore, "put", full_disk)
    code = main(["precompute", str(docs), "--store-dir", str(tmp_path / "kv")])
    err = capsys.readouterr().err
    assert code == 1
    _one_line(err, f"not stored: {docs / 'tomas.txt'}")
    assert "marta" not in err.strip().splitlines()[-1]


def test_chunk_stores_every_chunk_of_a_200k_character_file_whole(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines: list[BlendEngine] = []

    def from_pretrained(cls, model=None, *, store, **kwargs):  # noqa: ANN001, ANN202
        engines.append(_smollm2_engine(store))
        return engines[-1]

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(from_pretrained))
    rng = random.Random(0)
    words = "the river mill bread Hugo bakes at four ( 1932 ) , ; -- é 日本\n\n".split(" ")
    text = " ".join(rng.choice(words) for _ in range(70_000))[:200_000].strip()
    book = tmp_path / "book.txt"
    book.write_text(text)
    folder = tmp_path / "kv"
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        code = main(["precompute", str(book), "--chunk", "--store-dir", str(folder)])
    assert code == 0, capsys.readouterr().err
    (engine,) = engines
    pieces = chunks(engine, text, min(document_room(engine), DEFAULT_CHUNK_TOKENS))
    assert "".join(pieces) == text  # nothing stripped, nothing lost
    assert max(document_tokens(engine, piece) for piece in pieces) <= engine.context_window
    assert f"split into {len(pieces)} chunks" in caplog.text and "skipping" not in caplog.text
    with DiskKVStore(folder) as store:
        assert all(store.metadata(engine.segment_id(piece)) for piece in pieces)
    assert f"precomputed {len(pieces)} new documents" in capsys.readouterr().out
