"""Prepare, where there is a network, what the GPU suite needs on a GPU machine without one.

The GPU machine's image has torch, transformers, triton, safetensors, tokenizers, numpy and
xxhash (and what those need), and no network. ``python scripts/gpu_kit.py --out gpu_kit``
writes into one folder (inside the repository and gitignored, so it travels with the working
tree):

- ``site/``: the pure-Python packages the suite imports that the image lacks (`kit_packages`:
  the dependency closure of `NEEDED` less that of `IMAGE`), downloaded at exactly the installed
  versions as pure-Python wheels (``pip download --no-deps``) and unpacked;
- ``tokenizer/``: the bundled model's tokenizer files (the random-weight runs' tokenizer);
- ``RUN.md``: the commands to run there (``bash scripts/gpu_run.sh``, the 15-minute run).

`image_site` links exactly the image's packages (and their dependencies) of this environment
into a folder: with ``python -S`` and that folder, the kit's and ``src`` on the path, a CPU test
imports what the GPU run imports as the GPU machine would (`tests/bench/test_gpu_kit.py`).
"""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
#: The packages installed on the GPU machine's image.
IMAGE = ("torch", "transformers", "triton", "safetensors", "tokenizers", "numpy", "xxhash")
#: What any transformers since 4.56 needs: sure to be on the image. The rest of this
#: environment's transformers' dependencies (typer and its tree, in 5.x) may not be, so the kit
#: ships what the suite needs of them (pytest's pygments).
TRANSFORMERS_CORE = ("huggingface-hub", "packaging", "pyyaml", "regex", "tqdm", "filelock")
#: What the GPU suite imports beyond the image: the store (diskcache, platformdirs) and pytest.
NEEDED = ("diskcache", "platformdirs", "pytest")
#: The command a GPU machine runs, in the repository, once the kit is there.
SUITE = "PYTHONPATH=src python3 -m kvblend.bench gpu-suite --kit {kit}"
QUICK = "bash scripts/gpu_run.sh"


def _distribution(name: str) -> metadata.Distribution | None:
    try:
        return metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return None


def closure(names: Iterable[str]) -> set[str]:
    """Installed distributions ``names`` need, themselves included (markers of this Python).

    Extras are not followed; a name not installed here (``triton`` on a CPU machine) is left out.
    """
    found: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        dist = _distribution(name)
        if name in found or dist is None:
            continue
        found.add(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def kit_packages() -> list[str]:
    """Return the distributions the kit ships: what `NEEDED` needs that the image surely lacks.

    The image is taken to hold its packages but transformers with only `TRANSFORMERS_CORE`.
    """
    image = closure([name for name in IMAGE if name != "transformers"] + list(TRANSFORMERS_CORE))
    return sorted(closure(NEEDED) - image - {"transformers"})


def is_pure(name: str) -> bool:
    """Whether the installed distribution ``name`` came from a pure-Python wheel."""
    dist = _distribution(name)
    wheel = dist.read_text("WHEEL") if dist is not None else None
    if not wheel:
        return False
    lines = wheel.splitlines()
    tags = [line.split(":", 1)[1].strip() for line in lines if line.startswith("Tag:")]
    purelib = any(line.replace(" ", "").lower() == "root-is-purelib:true" for line in lines)
    return purelib and bool(tags) and all(tag.endswith("-none-any") for tag in tags)


def _top_level(dist: metadata.Distribution) -> set[str]:
    """Return the names a distribution puts at the top of site-packages (packages, modules)."""
    names = set()
    for file in dist.files or []:
        first = file.parts[0]
        if first not in ("..", "__pycache__") and not first.endswith(".pth"):
            names.add(first)
    return names


def link_distributions(names: Iterable[str], folder: Path) -> None:
    """Link the installed distributions ``names`` (packages, modules, info) into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        dist = _distribution(name)
        if dist is None:
            raise ValueError(f"{name} is not installed here")
        base = Path(str(dist.locate_file("")))
        for entry in _top_level(dist):
            link = folder / entry
            if not link.exists() and (base / entry).exists():
                link.symlink_to(base / entry)


def image_site(folder: Path, names: Iterable[str] = IMAGE) -> list[str]:
    """Link the installed distributions ``names`` need into ``folder``; return their names.

    ``folder`` then holds exactly those packages of this environment, as an image would.
    """
    chosen = sorted(closure(names))
    link_distributions(chosen, folder)
    return chosen


def download(names: Iterable[str], wheels: Path) -> list[Path]:
    """``pip download`` each distribution at its installed version, a pure-Python wheel only."""
    wheels.mkdir(parents=True, exist_ok=True)
    pins = [f"{name}=={metadata.version(name)}" for name in names]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "--implementation", "py", "--abi", "none", "--platform", "any",
         "--python-version", version, "--dest", str(wheels), *pins],
        check=True,
    )  # fmt: skip
    return sorted(wheels.glob("*.whl"))


def unpack(wheels: Iterable[Path], site: Path) -> None:
    """Unpack wheels into ``site`` (a wheel is the installed layout, zipped)."""
    site.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)


def save_tokenizer(folder: Path) -> list[str]:
    """Write the bundled model's tokenizer files into ``folder``."""
    import torch

    from kvblend.models.loading import load_model, resolve_model

    tokenizer = load_model(resolve_model(None), torch.device("cpu"), torch.float32)[1]
    return list(tokenizer.save_pretrained(str(folder)))


def size_mib(folder: Path) -> float:
    """Size of every file under ``folder``, in MiB."""
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def run_notes(kit: str) -> str:
    """``RUN.md``: what to run on the GPU machine, in order, within its 10-minute commands."""
    from kvblend.bench.gpu.suite import PARTS

    full = "\n".join(
        f'    {SUITE.format(kit=kit)} --steps {steps} --out "$OUT/full{part}"'
        for part, steps in enumerate(PARTS, start=1)
    )
    run = QUICK if kit == "gpu_kit" else f"K={kit} {QUICK}"
    return f"""# The GPU run on a machine without network

Copy this folder along with the repository (it is gitignored: name it in what carries ignored
paths). In the repository root, the one command of a 15-minute GPU run (under 9 minutes of
phases, each with its own limit; `$OUT` gets `kvr.tgz` and `summary.md`):

    {run}

With more time, the full suite in three commands of under 10 minutes each:

{full}

Copy back every ``$OUT`` folder; ``kvblend bench gpu-suite --summarize DIR ...`` merges
them. docs/benchmarks.md ("A GPU run") says what each measures.
"""


def main(argv: list[str] | None = None) -> int:
    """Write the kit; print its size and the command to run on the GPU machine."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "gpu_kit", help="the kit's folder")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    if out.exists():
        shutil.rmtree(out)
    names = kit_packages()
    impure = [name for name in names if not is_pure(name)]
    if impure:
        parser.error(f"not pure-Python here, cannot ship them: {', '.join(impure)}")
    with_wheels = out / "wheels"
    unpack(download(names, with_wheels), out / "site")
    shutil.rmtree(with_wheels)
    files = save_tokenizer(out / "tokenizer")
    kit = os.path.relpath(out, ROOT) if out.is_relative_to(ROOT) else str(out)
    (out / "RUN.md").write_text(run_notes(kit))
    print(f"packages: {', '.join(names)}")
    print(f"tokenizer: {len(files)} files")
    print(f"{out}: {size_mib(out):.1f} MiB")
    print(f"on the GPU machine, in the repository:\n  {QUICK}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
