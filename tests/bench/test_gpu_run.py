"""The GPU run (``scripts/gpu_run.sh``) fits one device command and runs green on the CPU.

A GPU run is one command of at most 10 minutes (about 15 in all with the machine's start), at
most 2,000 characters, whose files under ``$OUT`` come back. Here the script's text is checked
against those bounds, and it runs end to end with ``--device cpu`` the way the GPU machine
runs it: ``python3`` without this environment's site-packages (``-S``), only the packages the
GPU image has (this environment's, linked into a folder by ``scripts/gpu_kit.py``) and the
kit's, with ``src`` and ``tests`` on the path. Every phase must pass, ``$OUT`` must hold the
archive and the summary and nothing else, and a phase cut short by its limit must leave a
partial summary that says so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from conftest import byte_tokenizer
from kvblend.bench.gpu_run import OUTPUTS, PHASES

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_run.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_kit  # noqa: E402

#: Seconds of a GPU command's wall time the phases may take (9 minutes, a margin kept).
WALL = 540
#: What a phase costs beyond its limit at most: ``timeout -k 5``, the summary and the archive.
EXTRA = 5 + 5
#: Each phase's limit in the CPU run (``T``): one no phase reaches, however busy the machine.
#: The phases are timed for a GPU, and a CPU (a busy one more so) takes longer: this run checks
#: what they did, not how fast; the GPU limits are checked against the command's wall time
#: above, and a phase cut short by its limit by the test after it.
CPU_LIMIT = 900


def limits() -> dict[str, int]:
    """The phases' limits as the script's ``case`` gives them."""
    return {name: int(s) for name, s in re.findall(r"([\w-]+)\) l=(\d+);;", SCRIPT.read_text())}


def test_the_script_fits_one_device_command() -> None:
    text = SCRIPT.read_text()
    assert len(text) < 2000  # the device command's limit, the script is the command
    assert "python3" in text and "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1" in text
    phases = re.search(r"P=\$\{P:-([^}]*)\}", text)
    assert phases is not None and tuple(phases.group(1).split()) == PHASES
    assert set(limits()) == set(PHASES)
    assert sum(limits().values()) + EXTRA * len(PHASES) < WALL
    assert re.findall(r"\$O/[\w.]+", text) and set(re.findall(r"\$O/([\w.]+)", text)) == {
        "summary.md",
        "kvr.tgz",
    }  # the only files written under $OUT


@pytest.fixture(scope="module")
def device_image(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A ``python3`` that sees what the GPU image has, and a kit (its packages, a tokenizer)."""
    folder = tmp_path_factory.mktemp("gpu-machine")
    gpu_kit.image_site(folder / "image")
    kit = folder / "kit"
    gpu_kit.link_distributions(gpu_kit.kit_packages(), kit / "site")
    byte_tokenizer().save_pretrained(kit / "tokenizer")
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(
        f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{folder / "image"}" exec {sys.executable} -S "$@"\n'
    )
    python3.chmod(0o755)
    return bin_dir, kit


def run_script(
    device_image: tuple[Path, Path], tmp_path: Path, timeout: float = 1500, **env: str
) -> tuple[subprocess.CompletedProcess, Path, Path]:
    """Run the script on the CPU in the emulated image; return it, ``$OUT`` and its work folder."""
    bin_dir, kit = device_image
    out, work = tmp_path / "out", tmp_path / "kvr"
    environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(out),
                   "R": str(work), "K": str(kit), **env}  # fmt: skip
    environment.pop("PYTHONPATH", None)
    result = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu"], cwd=ROOT, env=environment, capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip
    return result, out, work


@pytest.mark.slow
def test_the_gpu_run_is_green_on_the_cpu(device_image: tuple[Path, Path], tmp_path: Path) -> None:
    result, out, _ = run_script(
        device_image, tmp_path, timeout=len(PHASES) * (CPU_LIMIT + 60), T=str(CPU_LIMIT)
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["kvr.tgz", "summary.md"]
    summary = (out / "summary.md").read_text()
    for phase in PHASES:
        assert f"| {phase} | ok |" in summary, summary
    with tarfile.open(out / "kvr.tgz") as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert set(OUTPUTS.values()) | {"phases.txt", "summary.md", "env.log"} <= names
    assert "compiled loop 1K reuse@compiled: TTFT" in summary and "compiling: " in summary
    assert re.search(r"compiled-tests \(pytest\): [1-9]\d* passed, 0 failed, 0 errors", summary)
    assert re.search(r"tests \(pytest\): [1-9]\d* passed, 0 failed", summary)


@pytest.mark.slow
def test_a_phase_cut_short_leaves_a_partial_summary(
    device_image: tuple[Path, Path], tmp_path: Path
) -> None:
    """A phase past its limit, one that fails: the others run, the summary says which."""
    result, out, _ = run_script(device_image, tmp_path, P="qwen nosuch", T="10", X="--repeats 200")
    assert result.returncode == 0
    assert sorted(p.name for p in out.iterdir()) == ["kvr.tgz", "summary.md"]
    summary = (out / "summary.md").read_text()
    assert "| qwen | timed out after 10 s |" in summary  # 200 repeats: minutes
    assert "| nosuch | failed (exit 2, see nosuch.log) |" in summary
    assert "qwen 1K: default <= 0.6 x transformers' forward, measured -, missing (step qwen: " \
        "timed out after 10 s)" in summary  # fmt: skip


def test_the_summary_reads_each_phase_status(tmp_path: Path) -> None:
    from kvblend.bench.gpu.suite_summary import read_phases, summarize

    (tmp_path / "phases.txt").write_text(
        "env rc=0 3s limit 20s\nqwen rc=124 60s limit 60s\ntests rc=1 40s limit 70s\n"
        "compiled rc=137 95s limit 90s\n"
    )
    steps = read_phases(tmp_path / "phases.txt")
    assert {name: step["status"] for name, step in steps.items()} == {
        "env": "ok",
        "qwen": "timed out after 60 s",
        "tests": "failed (exit 1, see tests.log)",
        "compiled": "timed out after 90 s",
    }
    (tmp_path / "gpu_compiled.json").write_text('{"ttft": {"summary": [')  # cut short
    result = summarize([tmp_path], {"llama-8b": [8192], "qwen": [8192]}, tiers=("memory",))
    figures = "\n".join(result["figures"])
    assert "gpu_compiled.json: unreadable" in figures
    assert "compiled loop: step compiled: timed out after 90 s" in figures
    assert "tests: step tests: failed (exit 1, see tests.log)" in figures
    assert len(result["targets"]) == 4 + 4  # one tier: 2 ratio targets, full, decode each


def test_the_gpu_runs_pytest_options_are_the_projects_without_its_workers() -> None:
    """`ONE_PROCESS` restates pyproject.toml's addopts less xdist's and the durations report."""
    import shlex

    import tomllib

    from kvblend.bench.gpu_run import ONE_PROCESS

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    project = shlex.split(pyproject["tool"]["pytest"]["ini_options"]["addopts"])
    workers = {"-n", "auto", "--dist", "loadfile", "--no-loadscope-reorder"}
    kept = [option for option in project if option not in workers]
    kept = [option for option in kept if not option.startswith("--durations")]
    assert ONE_PROCESS[0] == "-o" and ONE_PROCESS[1] == "addopts=" + " ".join(kept)
