"""The model fingerprint of a checkpoint folder, read a weight at a time: no second model in memory.

A server that loads a model itself (vLLM) still needs the engine's `model_fingerprint` of it, the
model part of every store key, to find the entries any kvblend process stored. Loading the
model a second time through transformers for that costs a second copy of the weights in memory
(a 70B model's 140 GB at first start). `checkpoint_fingerprint` gives the same fingerprint
without: transformers builds the model on the meta device (its weights' names, dtypes and
shapes, and which are tied, with no memory), and each weight is read from the folder's
safetensors files when it is hashed (memory-mapped, one at a time), cast to the dtype
transformers would load it in, and hashed as `weights_digest` hashes the loaded model's
(`digest_weights`: the same bytes in the same order, so the same key).

A folder it cannot read so (no safetensors files, a weight the files do not hold under the
model's own name, a model that keeps some weights in another dtype) gives None: the caller
loads the model to compute the fingerprint, as before.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvblend.models.fingerprint import Weight, digest_weights, fingerprint_of

logger = logging.getLogger(__name__)

__all__ = ["checkpoint_fingerprint"]


def _weight_files(folder: Path) -> dict[str, Path] | None:
    """Return which safetensors file of ``folder`` holds each weight (None: no safetensors)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text("utf-8"))["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


def _reader(path: Path, name: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """Return a function reading weight ``name`` from ``path`` in ``dtype`` when called."""

    def read() -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name).to(dtype)

    return read


def _meta_model(folder: Path, dtype: torch.dtype, trust_remote_code: bool) -> Any:
    """Build the model transformers builds from ``folder``'s config, on the meta device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=trust_remote_code
        )


def _weights(model: Any, files: dict[str, Path]) -> list[Weight] | None:
    """Return the model's weights as `digest_weights` takes them, from ``files`` (None: cannot)."""
    storage: dict[str, int] = {}  # name -> its tensor's identity (tied weights share one)
    for name, tensor in model.named_parameters(remove_duplicate=False):
        storage[name] = id(tensor)
    for name, tensor in model.named_buffers(remove_duplicate=False):
        storage[name] = id(tensor)
    held = {storage[name]: name for name in sorted(files, reverse=True) if name in storage}
    weights: list[Weight] = []
    for name, tensor in model.state_dict().items():
        source = name if name in files else held.get(storage.get(name, -1))
        if source is None:
            logger.debug("weight %s is not in the checkpoint under its name", name)
            return None
        read = _reader(files[source], source, tensor.dtype)
        weights.append((name, tensor.dtype, tuple(tensor.shape), storage[name], read))
    return weights


def checkpoint_fingerprint(
    folder: str | Path,
    tokenizer: object,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    *,
    trust_remote_code: bool = False,
) -> str | None:
    """Return `model_fingerprint` of ``folder``'s model loaded in ``dtype``, weights unloaded.

    None when the folder cannot be read a weight at a time (see the module).
    """
    folder = Path(folder).expanduser()
    files = _weight_files(folder) if folder.is_dir() else None
    if files is None:
        return None
    model = _meta_model(folder, dtype, trust_remote_code)
    if getattr(model, "_keep_in_fp32_modules", None):  # loaded in two dtypes: not read so
        return None
    weights = _weights(model, files)
    if weights is None:
        return None
    return fingerprint_of(model.config, digest_weights(weights), tokenizer, kv_dtype)
