"""Exit statuses and last lines of ``kvblend precompute`` that mean one thing each.

Status 0 when documents were stored (or were already), 1 when nothing requested was stored (a
file too long for the model, skipped), 2 for a mistake found before any work, 130 on Ctrl-C,
which says what was kept; the rerun says what it resumes. The last line counts the documents
computed now, those already stored and the files skipped apart.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.cli.main import main
from kvblend.cli.precompute import document_room
from kvblend.documents import segment_kv
from kvblend.store import MemoryKVStore

TEXTS = [f"Profile {i}: " + " ".join(f"fact{i}-{j}" for j in range(30)) for i in range(3)]


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> BlendEngine:
    """The CLI's model loads give one tiny engine over the store the CLI built."""
    made: dict[str, BlendEngine] = {}

    def from_pretrained(cls, model=None, *, store, **kwargs):  # noqa: ANN001, ANN202
        made["engine"] = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store)
        return made["engine"]

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(from_pretrained))
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


def _files(folder: Path, texts: list[str]) -> Path:
    folder.mkdir()
    for index, text in enumerate(texts):
        (folder / f"doc{index}.txt").write_text(text)
    return folder


def test_a_file_too_long_for_the_model_alone_exits_1(
    engine: BlendEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    big = tmp_path / "big.txt"
    big.write_text("word " * document_room(engine))
    code = main(["precompute", str(big), "--store-dir", str(tmp_path / "kv")])
    err = capsys.readouterr().err
    assert code == 1, err  # was 0, with "precomputed 0 documents"
    assert (
        err.strip().splitlines()[-1]
        == "kvblend: error: nothing was stored; 1 skipped (named above)"
    )


def test_already_stored_documents_are_not_counted_as_precomputed(
    engine: BlendEngine, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = _files(tmp_path / "docs", TEXTS)
    store = ["--store-dir", str(tmp_path / "kv")]
    assert main(["precompute", str(docs / "doc0.txt"), *store]) == 0
    assert capsys.readouterr().out.startswith("precomputed 1 new document in ")
    (docs / "notes.bin").write_bytes(b"\x00")
    assert main(["precompute", str(docs), *store]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("precomputed 2 new documents in ")
    assert first.endswith("; 1 document already stored; 1 skipped (named above)")
    assert main(["precompute", str(docs), *store]) == 0  # was "precomputed 3 documents in 0.0 s"
    first = capsys.readouterr().out.splitlines()[0]
    assert first == "nothing to compute: all 3 documents already stored; 1 skipped (named above)"


def test_ctrl_c_says_what_was_kept_and_the_rerun_what_it_resumes(
    engine: BlendEngine,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C raises KeyboardInterrupt where Python runs next: here, as the second batch starts."""
    docs = _files(tmp_path / "docs", TEXTS)
    store = ["--store-dir", str(tmp_path / "kv")]
    monkeypatch.setattr(
        segment_kv, "length_batches", lambda lengths, _: [[i] for i in range(len(lengths))]
    )
    compute_batch = segment_kv.SegmentKV.compute_batch
    calls = []

    def interrupted_at_the_second(self, *args, **kwargs):  # noqa: ANN001, ANN202
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return compute_batch(self, *args, **kwargs)

    monkeypatch.setattr(segment_kv.SegmentKV, "compute_batch", interrupted_at_the_second)
    assert main(["precompute", str(docs), *store]) == 130
    err = capsys.readouterr().err  # was: nothing
    assert "interrupted: 1 of 3 documents stored (1 computed here, " in err
    assert "run the same command again to compute the other 2" in err
    monkeypatch.setattr(segment_kv.SegmentKV, "compute_batch", compute_batch)
    assert main(["precompute", str(docs), *store]) == 0
    captured = capsys.readouterr()
    assert "resuming: 1 of 3 documents already stored, computing the other 2" in captured.err
    assert captured.out.startswith("precomputed 2 new documents in ")
    assert "; 1 document already stored" in captured.out.splitlines()[0]


CHILD = """
import sys
from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.cli.main import main

def from_pretrained(cls, model=None, *, store, **kwargs):
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store)

BlendEngine.from_pretrained = classmethod(from_pretrained)
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow  # a process that imports torch
def test_a_real_sigint_during_precompute_exits_130_naming_what_was_kept(tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text(" ".join(f"w{i}" for i in range(60_000)))  # ~100 chunks of the tiny model
    kv = tmp_path / "kv"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    argv = ["precompute", str(book), "--chunk", "--store-dir", str(kv), "--threads", "1"]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env=env, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and child.poll() is None:  # until an entry is written
        if any(kv.glob("*/*/*.val")):  # an entry file
            break
        time.sleep(0.05)
    assert child.poll() is None, child.communicate()
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130, err
    assert "interrupted: " in err and "run the same command again to compute the other" in err
