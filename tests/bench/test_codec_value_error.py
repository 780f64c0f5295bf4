"""scripts/codec_value_error.py: each codec's error on the K/V an engine really stores."""

from __future__ import annotations

import runpy
from pathlib import Path

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.store import MemoryKVStore

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "codec_value_error.py"
TEXTS = [
    "Mount Everest is Earth's highest mountain above sea level, in the Himalayas.",
    "The Pacific Ocean is the largest and deepest of Earth's five oceanic divisions.",
]


def test_errors_order_as_the_codes_bits_do() -> None:
    """8-bit codes decode closer than 4-bit ones, keys of both k8v4 versions are the same
    codes, and every error is a small positive share of the K/V's own energy."""
    relative_errors = runpy.run_path(str(SCRIPT))["relative_errors"]
    engine = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=MemoryKVStore())
    errors = relative_errors(engine, TEXTS)
    assert list(errors) == ["int8", "k8v4 v1", "k8v4", "int4"]
    assert all(0 < e["keys"] < 0.1 and 0 < e["values"] < 0.1 for e in errors.values())
    assert errors["int8"]["values"] < errors["k8v4"]["values"]
    assert errors["int8"]["values"] < errors["k8v4 v1"]["values"]
    assert errors["k8v4"]["keys"] == errors["k8v4 v1"]["keys"] == errors["int8"]["keys"]
    assert errors["int4"]["keys"] > errors["int8"]["keys"]
