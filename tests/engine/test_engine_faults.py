"""Store faults never reach the answer: damaged stored KV is recomputed within the same call.

A real disk store folder, real entry files, bytes flipped in the tensor data of the first, a
middle and the last layer: the next prefill over a fresh store object (as a new process would
open it) gives the same logits as before the damage, never an exception, and leaves an intact
entry behind; `precompute` repairs a damaged entry it finds.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.store import DiskKVStore, default_store

DOC = "Marta Quill keeps forty hives on the roof of an old printing house near the river. " * 4
PROMPT = f"Context: {DOC}\nQuestion: where are the hives?"


def engine_over(folder: Path, tiered: bool) -> BlendEngine:
    store = default_store(folder) if tiered else DiskKVStore(folder)
    return BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)


def damage(folder: Path, where: str) -> None:
    """Flip one byte in the tensor data of the only entry file: first, middle or last layer."""
    (path,) = sorted(folder.glob("*/*/*.val"))
    data = bytearray(path.read_bytes())
    header = 8 + struct.unpack("<Q", data[:8])[0]  # safetensors: header length, then JSON
    position = {"first": header + 3, "middle": (header + len(data)) // 2, "last": len(data) - 1}
    data[position[where]] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("tiered", [False, True], ids=["disk", "tiered"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_damaged_stored_kv_is_recomputed_in_the_same_call(
    tmp_path: Path, where: str, tiered: bool
) -> None:
    writer = engine_over(tmp_path, tiered)
    writer.precompute([DOC])
    expected = writer.prefill(PROMPT, BlendConfig("reuse"))
    assert expected.stats.documents_reused == 1 and expected.stats.segments_precomputed == 0
    damage(tmp_path, where)

    reader = engine_over(tmp_path, tiered)  # a fresh store object: nothing cached in memory
    got = reader.prefill(PROMPT, BlendConfig("reuse"))
    assert got.stats.documents_reused == 1
    assert torch.allclose(got.logits, expected.logits, atol=1e-5, rtol=0)
    key = reader.segment_id(DOC)
    assert engine_over(tmp_path, tiered).library.segment_kv.intact(key)  # stored again, intact


def test_precompute_repairs_an_entry_it_cannot_read(tmp_path: Path) -> None:
    engine = engine_over(tmp_path, tiered=False)
    engine.precompute([DOC])
    key = engine.segment_id(DOC)
    damage(tmp_path, "middle")
    fresh = engine_over(tmp_path, tiered=False)
    assert not fresh.library.segment_kv.intact(key)  # found damaged, and dropped
    fresh.precompute([DOC])
    assert engine_over(tmp_path, tiered=False).library.segment_kv.intact(key)
