"""Cache identity: fingerprints cover every weight element; GGUF conversions keyed by content."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import byte_tokenizer, tiny_model
from kvblend.models import loading
from kvblend.models.fingerprint import model_fingerprint, weights_digest
from kvblend.models.loading import converted_gguf_folder, file_digest


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


def _load(folder: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def test_the_same_model_in_two_folders_has_one_fingerprint(tmp_path: Path) -> None:
    model = tiny_model("qwen2")
    one, two = tmp_path / "one" / "model", tmp_path / "elsewhere" / "copy"
    model.save_pretrained(one)
    model.save_pretrained(two)
    first, second = _load(one), _load(two)
    assert first.config._name_or_path != second.config._name_or_path
    assert _fingerprint(first) == _fingerprint(second) == _fingerprint(model)
    # a changed weight element, saved in place of the first copy, gives another fingerprint
    with torch.no_grad():
        model.get_parameter("model.layers.0.self_attn.q_proj.weight").view(-1)[0] += 1e-3
    model.save_pretrained(one)
    assert _fingerprint(_load(one)) != _fingerprint(second)


def test_names_and_paths_in_the_config_are_not_identity() -> None:
    model, other = tiny_model("llama"), tiny_model("llama")
    other.config._name_or_path = "/home/someone/models/llama"
    other.config.transformers_version = "0.0.1"
    assert _fingerprint(model) == _fingerprint(other)
    other.config.rms_norm_eps = model.config.rms_norm_eps * 2  # an architecture field
    assert _fingerprint(model) != _fingerprint(other)


def test_tokenizer_and_kv_dtype_are_identity() -> None:
    model = tiny_model("llama")
    base = _fingerprint(model)
    assert model_fingerprint(model, byte_tokenizer(), torch.bfloat16) != base
    assert model_fingerprint(model, byte_tokenizer(bos=False), torch.float32) != base


def test_a_file_replaced_with_the_same_size_and_mtime_is_hashed_again(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"a" * 1000)
    first = file_digest(path)
    assert file_digest(path) == first  # remembered
    stat = path.stat()
    path.write_bytes(b"b" * 1000)  # same size ...
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # ... and mtime
    assert path.stat().st_size == stat.st_size and path.stat().st_mtime_ns == stat.st_mtime_ns
    assert file_digest(path) != first
    replacement = tmp_path / "other.bin"
    replacement.write_bytes(b"c" * 1000)
    os.utime(replacement, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(replacement, path)  # another file, same name, size and mtime
    assert file_digest(path) == hashlib.sha256(b"c" * 1000).hexdigest()
    loading._DIGESTS.clear()  # a new process reads the record from disk
    assert file_digest(path) == loading._read_digest_index()[str(path.resolve())][5]


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


@pytest.mark.parametrize(
    ("family", "tied", "dtype"),
    [("llama", True, torch.float32), ("mistral", False, torch.bfloat16),
     ("qwen2", True, torch.bfloat16), ("qwen3", False, torch.float32)],
)  # fmt: skip
def test_a_checkpoint_read_a_weight_at_a_time_has_the_loaded_models_fingerprint(
    tmp_path: Path, family: str, tied: bool, dtype: torch.dtype
) -> None:
    """vLLM's connector keys entries without loading the model a second time: the same key."""
    from kvblend.models.checkpoint import checkpoint_fingerprint

    model = tiny_model(family)
    model.config.tie_word_embeddings = tied
    model.tie_weights()
    folder = tmp_path / family
    model.save_pretrained(folder, max_shard_size="100KB")  # sharded: an index file
    tokenizer = byte_tokenizer()
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    expected = model_fingerprint(loaded, tokenizer, dtype)
    assert checkpoint_fingerprint(folder, tokenizer, dtype, dtype) == expected
    assert checkpoint_fingerprint(tmp_path / "none", tokenizer, dtype, dtype) is None
