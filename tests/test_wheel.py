"""The wheel the README tells a reader to build installs with its extras and imports the adapters.

`python -m build` runs on a copy of the clone's sources (the working tree is left as it is),
then pip installs the wheel with its ``langchain`` and ``llamaindex`` extras into a fresh
virtual environment. That environment sees this one's packages through a ``.pth`` line, and pip
runs with ``--no-index``: it must find every dependency the extras declare among the installed
packages (a declared package that is missing fails the install), and downloads nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _copy_sources(target: Path) -> None:
    """What the build reads: pyproject.toml, the README (the long description) and src/."""
    target.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, target / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*.pyc")
    shutil.copytree(ROOT / "src", target / "src", ignore=ignore)


def _run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run(
        [str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _fresh_venv(venv: Path) -> Path:
    """A virtual environment that sees this one's packages after its own; returns its python."""
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    purelib = _run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # this environment's packages after the fresh one's own: the wheel's kvblend comes first,
    # and the editable install here is not loaded (a plain path line runs no .pth file there)
    Path(purelib.strip(), "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


@pytest.mark.slow
def test_the_built_wheel_installs_with_its_extras_and_imports_the_adapters(tmp_path: Path) -> None:
    pytest.importorskip("build", reason="needs the dev extra's build")
    sources, dist, venv = tmp_path / "kvblend", tmp_path / "dist", tmp_path / "venv"
    _copy_sources(sources)
    # sdist first, then the wheel built from the sdist (what `python -m build` does by default):
    # a file the sdist leaves out is missing from the wheel too. --no-isolation: this
    # environment's setuptools, no download.
    _run(sys.executable, "-m", "build", "--no-isolation", "--outdir", dist, sources)
    (wheel,) = dist.glob("kvblend-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvblend/data/sample_corpus.json" in names and "kvblend/py.typed" in names

    python = _fresh_venv(venv)
    _run(python, "-m", "pip", "install", "--no-index", "--quiet",
         f"{wheel}[langchain,llamaindex]")  # fmt: skip

    imported = _run(python, "-c", (
        "import kvblend, kvblend.langchain, kvblend.llamaindex\n"
        "from kvblend.langchain import BlendLLM, BlendRetriever, ChatBlend\n"
        "from kvblend.llamaindex import BlendLLM as IndexLLM\n"
        "from kvblend.samples import sample_corpus\n"
        "assert sample_corpus()['documents']\n"
        "print(kvblend.__file__)"
    ))  # fmt: skip
    assert Path(imported.strip()).is_relative_to(venv), imported
    assert "usage: kvblend" in _run(venv / "bin" / "kvblend", "--help")


@pytest.mark.slow
def test_an_extra_naming_a_missing_package_fails_the_install(tmp_path: Path) -> None:
    """The check above can fail: a wheel whose extra needs an absent package is refused."""
    pytest.importorskip("build", reason="needs the dev extra's build")
    sources, dist, venv = tmp_path / "kvblend", tmp_path / "dist", tmp_path / "venv"
    _copy_sources(sources)
    pyproject = sources / "pyproject.toml"
    text = pyproject.read_text()
    marker = 'langchain = ["langchain-core>=1.0"'
    assert marker in text
    pyproject.write_text(text.replace(marker, 'langchain = ["no-such-package-kvblend-test"'))
    _run(sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", dist, sources)
    (wheel,) = dist.glob("kvblend-*.whl")
    python = _fresh_venv(venv)
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--no-index", "--quiet", f"{wheel}[langchain]"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0 and "no-such-package-kvblend-test" in done.stderr, done.stderr
