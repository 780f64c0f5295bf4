"""Which dtype a model computes in: ``"auto"`` from the checkpoint's dtype and the device's units.

transformers' ``from_pretrained(dtype="auto")`` follows the checkpoint: bfloat16 for almost every
instruct model on the Hub. kvblend's ``"auto"`` (the default) follows it where the device
computes bfloat16 fast, and computes in float32 where it does not:

- a checkpoint stored in float32 runs in float32, as transformers runs it;
- any other (bfloat16 or float16 weights, a quantized GGUF file, a checkpoint that states no
  dtype) runs in bfloat16 where the device has bfloat16 matrix units (a CUDA GPU of compute
  capability 8.0 or later; an x86 CPU with AVX512-BF16 or AMX), and in float32 elsewhere, where
  a bfloat16 matrix product runs several times slower than a float32 one.

`choose_dtype` applies the rule and returns a `DtypeChoice`: the dtype with what decided it, as
fields, rendered to a sentence by ``str()``. `bf16_units` is the device's side (a CPU's comes from
`cpu_bf16_units`, one function that tests replace to simulate another CPU); a `Checkpoint` is the
checkpoint's side, read by `kvblend.models.loading.checkpoint_dtype` only when the device's units
make it matter. float32 is the exact reference: ask for it (``dtype="float32"``) to compare with
figures measured in it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "AUTO",
    "DTYPE_NAMES",
    "Checkpoint",
    "DtypeChoice",
    "bf16_units",
    "choose_dtype",
    "cpu_bf16_units",
    "dtype_name",
]

#: The name of the automatic choice (``None`` means the same).
AUTO = "auto"

#: The names a dtype may be asked for by.
DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "fp16": torch.float16,
    "float16": torch.float16,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint says of its own dtype."""

    #: The dtype its weights are stored in (config ``dtype`` / ``torch_dtype``); None when it
    #: states none or its weights are quantized.
    dtype: torch.dtype | None = None
    #: Quantized weights (a GGUF file), dequantized on load: no float dtype of their own.
    quantized: bool = False

    def __str__(self) -> str:
        if self.quantized:
            return "a quantized GGUF file"
        if self.dtype is None:
            return "of no stated dtype"
        return dtype_name(self.dtype)


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model computes in, and what decided it (``str()``: both in one line)."""

    dtype: torch.dtype
    #: What was asked: ``"auto"``, a dtype's name (``"bf16"``, ``"float32"``...), or
    #: ``"model"`` for a model passed in already loaded (its own dtype).
    requested: str
    #: The device's type (``"cpu"``, ``"cuda"``, ``"mps"``).
    device: str = "cpu"
    #: The device's bfloat16 matrix units (`bf16_units`), None when it has none (``"auto"`` only).
    units: str | None = None
    #: The checkpoint's own dtype, when ``"auto"`` read it (None: not read).
    checkpoint: Checkpoint | None = None

    @property
    def reason(self) -> str:
        """Why this dtype, in words."""
        if self.requested == "model":
            return "the dtype of the model passed in"
        if self.requested != AUTO:
            return "asked for"
        if self.units is None:
            where = {"cpu": "this CPU has", "cuda": "this GPU has"}.get(
                self.device, f"{self.device} devices have"
            )
            needed = {"cpu": " (AVX512-BF16 or AMX)", "cuda": " (compute capability 8.0+)"}
            return (
                f"auto: {where} no bfloat16 matrix units{needed.get(self.device, '')}, where "
                "bfloat16 runs slower than float32"
            )
        if self.checkpoint is not None and self.checkpoint.dtype == torch.float32:
            return "auto: the checkpoint is float32"
        kind = f"; the checkpoint is {self.checkpoint}" if self.checkpoint is not None else ""
        return f"auto: the {self.device} has bfloat16 matrix units ({self.units}){kind}"

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)} ({self.reason})"


def cpu_bf16_units() -> str | None:
    """Return the CPU's bfloat16 matrix units as torch detects them (AMX, AVX512-BF16) or None.

    torch's own CPU feature checks (``torch.cpu._is_amx_tile_supported``,
    ``_is_avx512_bf16_supported``; present since torch 2.2): x86 only, so other CPUs report none.
    """
    checks = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    for name, check in checks:
        found = getattr(torch.cpu, check, None)
        if found is not None and found():
            return name
    return None


def bf16_units(device: torch.device) -> str | None:
    """Return the device's bfloat16 matrix units in words, or None when it has none.

    CUDA: compute capability 8.0 or later (tensor cores with bfloat16; earlier GPUs emulate it).
    CPU: `cpu_bf16_units`. Other devices: none.
    """
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return f"compute capability {major}.{minor}" if major >= 8 else None
    if device.type == "cpu":
        return cpu_bf16_units()
    return None


def choose_dtype(
    dtype: torch.dtype | str | None,
    device: torch.device,
    checkpoint: Callable[[], Checkpoint] | None = None,
) -> DtypeChoice:
    """Apply the module's rule: a dtype (or its name) as asked, ``"auto"`` / None by the rule.

    ``checkpoint`` reads the checkpoint's own dtype, called only when it decides (``"auto"`` on a
    device with bfloat16 units); None: a checkpoint of no stated dtype.
    """
    if isinstance(dtype, torch.dtype):
        return DtypeChoice(dtype, dtype_name(dtype), device.type)
    if dtype is None or dtype == AUTO:
        units = bf16_units(device)
        if units is None:
            return DtypeChoice(torch.float32, AUTO, device.type)
        stored = checkpoint() if checkpoint is not None else Checkpoint()
        chosen = torch.float32 if stored.dtype == torch.float32 else torch.bfloat16
        return DtypeChoice(chosen, AUTO, device.type, units, stored)
    if dtype not in DTYPE_NAMES:
        raise ValueError(
            f"unknown dtype {dtype!r}; choose {AUTO} or one of {', '.join(DTYPE_NAMES)}"
        )
    return DtypeChoice(DTYPE_NAMES[dtype], dtype, device.type)
