"""The GPU run imports with only the GPU machine's packages and the kit's: checked on the CPU.

The GPU machine has torch, transformers, triton, safetensors, tokenizers, numpy and xxhash (and
what they need), no network, and what ``scripts/gpu_kit.py`` prepared. Here a Python without
site-packages (``-S``) sees exactly those packages of this environment (linked into a folder by
`gpu_kit.image_site`) plus the kit's (`gpu_kit.kit_packages`, linked likewise) and ``src``; in
it the engine, the store, ``bench gpu`` and the GPU suite import, the CUDA tests are collected
with the suite's ``cuda_only`` plugin, and a tiny ``bench gpu`` runs on the CPU. An import the
image cannot satisfy fails here, not on the GPU machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import byte_tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_kit  # noqa: E402

from kvblend.bench.gpu import suite as gpu_suite  # noqa: E402
from kvblend.bench.gpu_run import ONE_PROCESS  # noqa: E402

#: Modules the GPU suite's steps import (``cuda_only``: the pytest plugin in ``tests/``).
MODULES = (
    "kvblend", "kvblend.engine", "kvblend.store", "kvblend.cli.main", "kvblend.bench.cli",
    "kvblend.bench.gpu.figures", "kvblend.bench.speed.ttft", "kvblend.bench.speed.ingest",
    "kvblend.cli.args",
    "kvblend.bench.gpu.random_models", "kvblend.models.loading", "kvblend.prompt.splice",
    "kvblend.bench.gpu.suite", "kvblend.bench.gpu.suite_summary", "kvblend.bench.gpu.decode",
    "kvblend.bench.gpu_run",
    "cuda_only",
)  # fmt: skip


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The import path of the GPU machine: ``src``, the tests, the kit, the image."""
    folder = tmp_path_factory.mktemp("gpu-machine")
    gpu_kit.image_site(folder / "image")
    gpu_kit.link_distributions(gpu_kit.kit_packages(), folder / "kit")
    return [str(ROOT / "src"), str(ROOT / "tests"), str(folder / "kit"),
            str(folder / "image")]  # fmt: skip


def run_there(sites: list[str], code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """Run ``code`` in a Python that sees only ``sites`` besides the standard library."""
    bootstrap = f"import sys; sys.path[:0] = {sites!r}\n{code}"
    return subprocess.run(
        [sys.executable, "-S", "-c", bootstrap], cwd=cwd, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip


def test_the_kit_ships_the_pure_python_packages_the_image_lacks() -> None:
    names = gpu_kit.kit_packages()
    assert {"diskcache", "platformdirs", "pytest", "pluggy", "iniconfig"} <= set(names)
    assert not {"torch", "transformers", "numpy", "xxhash", "safetensors"} & set(names)
    assert all(gpu_kit.is_pure(name) for name in names)
    assert not gpu_kit.is_pure("torch") and not gpu_kit.is_pure("numpy")


def test_the_emulated_image_lacks_what_the_kit_brings(sites: list[str]) -> None:
    """Without the kit the store cannot import (diskcache): the emulation is not the venv."""
    image_only = [site for site in sites if not site.endswith("kit")]
    result = run_there(image_only, "import kvblend.store")
    assert result.returncode != 0 and "diskcache" in result.stderr
    result = run_there(image_only, "import kvblend.engine; import torch, transformers")
    assert result.returncode == 0, result.stderr  # the engine needs nothing beyond the image


def test_the_gpu_run_imports_with_the_image_and_the_kit(sites: list[str]) -> None:
    code = "import importlib\nfor name in {!r}:\n    importlib.import_module(name)\n"
    result = run_there(sites, code.format(MODULES))
    assert result.returncode == 0, result.stderr


def test_the_cuda_tests_are_collected_with_the_image_and_the_kit(sites: list[str]) -> None:
    argv = ["pytest", *ONE_PROCESS, "-p", "cuda_only", "-p", "no:cacheprovider", "--collect-only",
            "-q", *gpu_suite.CUDA_TESTS]  # fmt: skip
    code = f"import runpy\nsys.argv = {argv!r}\nrunpy.run_module('pytest', run_name='__main__')"
    result = run_there(sites, code)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert " deselected" in result.stdout and "error" not in result.stdout.lower()


def test_bench_gpu_runs_with_the_image_and_the_kit(sites: list[str], tmp_path: Path) -> None:
    """A tiny ``bench gpu`` on the CPU: every tier (the disk one needs the kit's diskcache)."""
    byte_tokenizer().save_pretrained(tmp_path / "tok")
    argv = ["kvblend", "bench", "gpu", "--device", "cpu", "--dtype", "float32", "--model-shape",
            "tiny", "--tokenizer", str(tmp_path / "tok"), "--lengths", "128", "--doc-tokens",
            "32", "--repeats", "1", "--decode-tokens", "0", "--ingest-documents", "0",
            "--strategies", "full,reuse", "--output", str(tmp_path / "gpu.json")]  # fmt: skip
    code = f"from kvblend.cli.main import main\nsys.argv = {argv!r}\nraise SystemExit(main())"
    result = run_there(sites, code, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (tmp_path / "gpu.json").exists()
