"""Cache identity: fingerprints cover every weight element; GGUF conversions keyed by content."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import byte_tokenizer, tiny_model
from kvblend.engine import loading
from kvblend.engine.loading import (
    converted_gguf_folder,
    file_digest,
    model_fingerprint,
    weights_digest,
)


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(loading.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(loading, "_DIGESTS", {})
    return tmp_path / "cache"


def _fingerprint(model: torch.nn.Module) -> str:
    return model_fingerprint(model, byte_tokenizer(), torch.float32)


def test_every_weight_element_is_in_the_fingerprint() -> None:
    base = _fingerprint(tiny_model("llama"))
    assert _fingerprint(tiny_model("llama")) == base  # deterministic
    # the last element of the last layer's last projection, and of the (large) embedding
    for name in ("model.layers.2.mlp.up_proj.weight", "model.embed_tokens.weight"):
        model = tiny_model("llama")
        with torch.no_grad():
            model.get_parameter(name).view(-1)[-1] += 1e-3
        assert _fingerprint(model) != base, name


def test_tied_weights_are_hashed_once_but_named() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from conftest import TINY

    torch.manual_seed(0)
    tied = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True)).eval()
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    before = weights_digest(tied)
    with torch.no_grad():
        tied.lm_head.weight.view(-1)[-1] += 1.0  # changes both names: one storage
    assert weights_digest(tied) != before


def test_a_folder_model_is_identified_by_its_weight_files(tmp_path: Path) -> None:
    folder = tmp_path / "model"
    tiny_model("qwen2").save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert loading._weight_files(loaded) == [folder / "model.safetensors"]
    in_memory = tiny_model("qwen2")
    # the same weights: the folder's file hash stands for them
    assert _fingerprint(loaded) == _fingerprint(loaded)
    assert file_digest(folder / "model.safetensors") in loading._digest_index().read_text()
    # another model saved in the same folder gets another fingerprint
    other = tiny_model("qwen2", seed=1)
    first = _fingerprint(loaded)
    other.save_pretrained(folder)
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert _fingerprint(reloaded) != first
    assert _fingerprint(in_memory) != _fingerprint(tiny_model("qwen2", seed=1))


def test_file_digest_is_cached_by_path_size_and_mtime(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    first = file_digest(path)
    stat = path.stat()
    path.write_bytes(b"b" * 1000)  # same size ...
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and mtime: the record holds
    assert file_digest(path) == first
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten later: rehashed
    assert file_digest(path) != first
    loading._DIGESTS.clear()  # a new process reads the record from disk
    assert file_digest(path) == loading._read_digest_index()[str(path.resolve())][2]


def test_a_damaged_digest_record_is_ignored(private_cache: Path, tmp_path: Path) -> None:
    private_cache.mkdir(parents=True)
    (private_cache / "file-digests.json").write_text('{"x": [1, "not a number"]')
    path = tmp_path / "weights.bin"
    path.write_bytes(b"abc")
    assert file_digest(path) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


def test_gguf_conversion_is_keyed_by_the_whole_content(tmp_path: Path) -> None:
    one, two = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for path, last in ((one, b"\x01"), (two, b"\x02")):
        path.parent.mkdir()
        path.write_bytes(b"GGUF" + b"\x00" * (3 << 20) + last)  # same name, size, first MiB
    assert converted_gguf_folder(one) != converted_gguf_folder(two)
    assert converted_gguf_folder(one).name.startswith("model-")
