"""``kvblend precompute`` over a folder: files that fit are stored, the others named; no torch
for ``--help``; the help's defaults are `BlendConfig`'s."""

from __future__ import annotations

import logging
import subprocess
import sys
import time

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.cli_args import DEFAULT_CORRECTION, DEFAULT_RATIO, STRATEGIES, default_threads
from kvblend.cli_precompute import document_room, fitting_documents, precompute_each
from kvblend.engine.selectors import strategy_names
from kvblend.store import MemoryKVStore


@pytest.fixture
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


def test_a_file_too_long_is_named_and_skipped_and_the_others_stored(
    engine: BlendEngine, caplog: pytest.LogCaptureFixture
) -> None:
    room = document_room(engine)
    named = [("a.txt", "Marta lives in Lisbon."), ("big.txt", "word " * room),
             ("b.txt", "Tomas lives in Cremona.")]  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        documents = fitting_documents(engine, named, chunk=False)
        stored = precompute_each(engine, documents)
    assert [name for name, _ in documents] == ["a.txt", "b.txt"] and stored == 2
    assert [r.getMessage() for r in caplog.records if "big.txt" in r.getMessage()] == [
        f"skipping big.txt: {len(engine.tokenize('word ' * room))} tokens, longer than "
        f"{engine.name}'s context window leaves a document ({room}); --chunk splits it"
    ]
    assert engine.is_known("Marta lives in Lisbon.")


def test_chunk_splits_a_long_file_into_documents_that_fit(engine: BlendEngine) -> None:
    room = document_room(engine)
    text = " ".join(f"w{i}" for i in range(room))  # about 4 x room tokens
    documents = fitting_documents(engine, [("big.txt", text)], chunk=True)
    assert len(documents) >= 3
    assert all(len(engine.tokenize(piece)) <= room for _, piece in documents)
    assert precompute_each(engine, documents) == len(documents)
    assert " ".join(piece for _, piece in documents).split() == text.split()


def test_one_refused_document_does_not_cost_the_batch(
    engine: BlendEngine, caplog: pytest.LogCaptureFixture
) -> None:
    bad = "Lone surrogate \udcff here."
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        stored = precompute_each(engine, [("a.txt", "Marta lives in Lisbon."), ("bad.txt", bad)])
    assert stored == 1 and "skipping bad.txt" in caplog.text


def test_help_imports_no_torch_and_states_the_real_defaults() -> None:
    code = (
        "import sys\n"
        "from kvblend.cli import main\n"
        "for argv in (['--help'], ['precompute', '--help'], ['explain', '--help']):\n"
        "    assert main(argv) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    print(f"kvblend --help and two subcommand helps: {time.perf_counter() - started:.2f} s")
    assert done.returncode == 0, done.stderr
    assert "--threads" in done.stdout and "--chunk" in done.stdout
    assert STRATEGIES[0] == BlendConfig().strategy
    assert set(STRATEGIES) == set(strategy_names())
    assert (DEFAULT_RATIO, DEFAULT_CORRECTION) == (
        BlendConfig().recompute_ratio, BlendConfig().correction
    )  # fmt: skip


def test_default_threads_is_at_least_one_and_at_most_the_cores() -> None:
    import os

    assert 1 <= default_threads() <= (os.cpu_count() or 1)
