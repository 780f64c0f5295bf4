"""Fault injection, read-only folders: listing, statistics, repair and the registry still work.

The folder is made read-only the way it is in deployments: a read-only bind mount for root
(which ignores permission bits, so ``chmod`` would not stop it writing), file modes for anyone
else (`test_store_faults._read_only`). On it, `keys()` lists every entry, `stats()` says the
store is read-only, ``kvblend store stats`` and ``kvblend store repair`` say so and change
nothing (a healthy folder is reported healthy), and an engine finds every document from the
entries' own metadata even when the folder has no ``records/`` (the registry's log): prompt
strings reuse every document, nothing is computed, nothing in the folder changes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.cli.main import main
from kvblend.store import DiskKVStore, default_store
from test_store_faults import _read_only

DOCS = [
    f"Document {index}: the orchard on terrace {index} gives {index * 11} crates of pears. "
    for index in range(8)
]


def _prompt(doc: str) -> str:
    return f"Context: {doc}\nQuestion: how many crates?"


def _filled(folder: Path) -> tuple[list[str], dict[str, torch.Tensor]]:
    """Precompute DOCS into `folder`; return their keys and each prompt's reuse logits."""
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=DiskKVStore(folder))
    keys = engine.precompute(DOCS)
    answers = {doc: engine.prefill(_prompt(doc), BlendConfig("reuse")).logits for doc in DOCS}
    engine.store.close()
    return keys, answers


def _snapshot(folder: Path) -> dict[str, bytes]:
    """Every file's bytes but SQLite's shared-memory and WAL files (SQLite's own business)."""
    return {
        str(path.relative_to(folder)): path.read_bytes()
        for path in folder.rglob("*")
        if path.is_file() and not path.name.endswith(("-shm", "-wal"))
    }


def test_keys_stats_and_the_cli_work_on_a_read_only_store(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "kv"
    keys, _ = _filled(folder)
    with _read_only(folder) as view:
        before = _snapshot(view)
        store = DiskKVStore(view)
        assert store.read_only
        assert sorted(store.keys()) == sorted(keys)  # no AttributeError
        stats = store.stats()
        assert stats.read_only and stats.entries == len(DOCS)
        tiered = default_store(view)
        assert sorted(tiered.keys()) == sorted(keys) and tiered.stats().read_only
        report = store.repair()
        assert report.read_only and not report.index_set_aside and not report.index_damaged
        assert (report.rows_broken, report.files_unindexed, report.entries) == (0, 0, len(DOCS))
        store.close()
        tiered.close()

        assert main(["store", "stats", "--store-dir", str(view)]) == 0
        out = capsys.readouterr().out
        assert f"entries: {len(DOCS)}" in out and "read-only" in out
        assert main(["store", "repair", "--store-dir", str(view)]) == 0
        out = capsys.readouterr().out
        assert "read-only: nothing was changed" in out and "index: ok" in out
        assert "healthy" in out.splitlines()[-1] and "damaged" not in out
        assert _snapshot(view) == before


def test_a_read_only_repair_reports_what_it_finds_and_leaves_it(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "kv"
    _filled(folder)
    files = sorted(folder.glob("*/*/*.val"))
    files[0].unlink()  # a row without its file
    stray = folder / "ab" / "cd" / ("5" * 28 + ".val")  # a value file no row names
    stray.parent.mkdir(parents=True, exist_ok=True)
    stray.write_bytes(b"x" * 100)
    with _read_only(folder) as view:
        before = _snapshot(view)
        assert main(["store", "repair", "--store-dir", str(view)]) == 0
        out = capsys.readouterr().out
        assert "index rows without a valid file: 1" in out
        assert "value files no index row names: 1" in out
        assert "run repair where the folder can be written" in out
        assert _snapshot(view) == before


@pytest.mark.parametrize("records", ["kept", "deleted"])
def test_prompt_strings_find_every_document_on_a_read_only_store(
    tmp_path: Path, records: str
) -> None:
    folder = tmp_path / "kv"
    _, answers = _filled(folder)
    if records == "deleted":
        shutil.rmtree(folder / "records")  # the registry's log is gone: only entries name them
    with _read_only(folder) as view:
        before = _snapshot(view)
        for store in (DiskKVStore(view), default_store(view)):
            engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
            for doc in DOCS:  # no register(): found from the log, else from the entries
                got = engine.prefill(_prompt(doc), BlendConfig("reuse"))
                assert got.stats.documents_found == 1 and got.stats.documents_reused == 1
                assert got.stats.segments_precomputed == 0
                assert torch.allclose(got.logits, answers[doc], atol=1e-5, rtol=0)
            assert engine.library.registry.rebuilds == (1 if records == "deleted" else 0)
            assert store.stats().corrupt_dropped == 0
            store.close()
        assert _snapshot(view) == before
