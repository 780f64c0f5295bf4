"""A store folder's record logs on a read-only or full disk, and never through a symbolic link.

The registry of known documents lives in the folder's ``records/records.db``. A folder that can
only be read still holds it: a fresh process over it finds every document from the log (no
rebuild from the entries, nothing precomputed), and appends fail without touching a byte. A
record log whose folder or SQLite files are symbolic links is refused, never followed.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.store import DiskKVStore
from kvblend.store.record_logs import DiskRecordLogs
from test_store_faults import DOCS, _filled, _full_disk, _question, _read_only, _snapshot


def _without_sqlite_scratch(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: data for name, data in files.items() if not name.endswith(("-shm", "-wal"))}


@pytest.mark.parametrize("fault", ["read-only", "full"])
def test_a_fresh_process_over_a_read_only_or_full_folder_finds_its_documents(
    tmp_path: Path, fault: str
) -> None:
    with contextlib.ExitStack() as stack:
        if fault == "full":
            folder = stack.enter_context(_full_disk(tmp_path)) / "kv"
            _filled(folder)
            with contextlib.suppress(OSError), (folder.parent / "ballast").open("wb") as file:
                while True:
                    file.write(b"\0" * (64 << 10))
            view = folder
        else:
            _filled(tmp_path / "kv")
            view = stack.enter_context(_read_only(tmp_path / "kv"))
        before = _snapshot(view)
        store = DiskKVStore(view)
        assert isinstance(store._records, DiskRecordLogs)
        assert store._records.read_only  # a full disk cannot open it for writing either
        engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)  # no register
        for doc in DOCS:
            assert engine.is_known(doc)
            stats = engine.prefill(_question(doc), BlendConfig("reuse")).stats
            assert stats.documents_reused == 1 and stats.segments_precomputed == 0
        assert engine.library.registry.rebuilds == 0  # read from the log, not rebuilt from entries
        engine.register(["A document the folder cannot take. " * 3])  # append fails: warned
        store.close()
        assert _without_sqlite_scratch(_snapshot(view)) == _without_sqlite_scratch(before)


def test_a_read_only_record_log_reads_and_refuses_appends(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    logs = DiskRecordLogs(folder / "records")
    logs.append("log", [b"one", b"two"])
    logs.close()
    with _read_only(folder) as view:
        reader = DiskRecordLogs(view / "records")
        assert reader.read_only
        records, cursor = reader.read("log")
        assert records == [b"one", b"two"] and reader.read("log", cursor) == ([], cursor)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.append("log", [b"three"])
        reader.close()
    assert DiskRecordLogs(folder / "records").read("log")[0] == [b"one", b"two"]


def test_a_new_record_log_on_a_read_only_disk_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "kv" / "records").mkdir(parents=True)
    with _read_only(tmp_path / "kv") as view, pytest.raises((OSError, sqlite3.Error)):
        DiskRecordLogs(view / "records")  # nothing to read: the caller keeps logs in memory


@pytest.mark.parametrize(
    "link", ["records", "records/records.db", "records/records.db-wal", "records/records.db-shm"]
)
def test_a_linked_record_log_is_refused(tmp_path: Path, link: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "records.db").write_bytes(b"")
    folder = tmp_path / "kv"
    (folder / "records").mkdir(parents=True)
    if link == "records":
        (folder / "records").rmdir()
    (folder / link).symlink_to(outside if link == "records" else outside / "records.db")
    with pytest.raises(OSError, match="symbolic link"):
        DiskRecordLogs(folder / "records")
    assert sorted(p.name for p in outside.iterdir()) == ["records.db"]
    assert (outside / "records.db").read_bytes() == b""


def test_a_record_file_replaced_by_a_link_is_refused_when_reopened(tmp_path: Path) -> None:
    outside = tmp_path / "outside.db"
    outside.write_bytes(b"")
    logs = DiskRecordLogs(tmp_path / "records")
    logs.append("log", [b"one"])
    for suffix in ("", "-wal", "-shm"):
        Path(f"{logs.path}{suffix}").unlink(missing_ok=True)
    logs.path.symlink_to(outside)
    with pytest.raises(OSError, match="symbolic link"):
        logs.read("log")
    assert outside.read_bytes() == b""
