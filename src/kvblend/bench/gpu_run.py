"""The phases of the GPU run: what ``scripts/gpu_run.sh`` runs, one process per phase.

A lent GPU machine gives about 15 minutes in all, its start (1-2 minutes) included, in commands
of at most 10 minutes, and copies back what the command leaves under ``$OUT``. The shell script
is that one command: it runs each phase here as ``python3 -m kvblend.bench.gpu_run PHASE``
under its own time limit (a hang or a crash loses that phase alone), then, after every phase,
the summary (``python3 -m kvblend.bench.gpu_run summary``) and the archive, so a phase cut
short still leaves a partial summary. In order, the figures first:

- ``env``: the GPU, torch, transformers and triton versions;
- ``llama-8b``, ``qwen``: ``kvblend bench gpu`` at 8K tokens for a model of Llama-3.1-8B's and
  of Qwen2.5-0.5B's shape (random weights): full, the default and ``reuse``, the documents in
  the GPU's memory and in pinned host memory, against transformers' forward and ``generate``;
- ``tests``: the tests with a CUDA path (`suite.CUDA_TESTS` but the compiled loop's),
  ``pytest -p cuda_only --device cuda``;
- ``compiled``: ``bench gpu`` of the Qwen shape, the default and ``reuse`` eager and through the
  compiled layer loop (``@compiled``: one graph per size bucket for every layer, CUDA graphs),
  interleaved, with the first compiled prefill's time (its compile);
- ``compiled-tests``: the compiled loop's and FlexAttention's tests on CUDA (fifty prompt
  lengths through the compiled kernel, one graph for every layer, no CUDA graph skipped).

``--device cpu`` runs every phase's code path on the CPU with tiny settings (the ``tiny``
shape, 1K tokens, one repeat, a few quick tests): what a CPU test of the script runs.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

#: The phases in the order the script runs them.
PHASES = ("env", "llama-8b", "qwen", "tests", "compiled", "compiled-tests")
#: The compiled loop's tests: their own phase, last.
COMPILED_TESTS = ("tests/blend/test_flex.py", "tests/blend/test_compiled_loop.py")
#: Result files, by phase (`kvblend.bench.gpu.suite_summary` reads them by these names).
OUTPUTS = {
    "llama-8b": "gpu_llama8b.json",
    "qwen": "gpu_qwen.json",
    "compiled": "gpu_compiled.json",
    "tests": "tests.xml",
    "compiled-tests": "compiled-tests.xml",
}


def bench_argv(phase: str, cpu: bool, kit: Path, out: Path) -> list[str]:
    """``kvblend bench gpu`` options of a bench phase."""
    shape = "tiny" if cpu else {"llama-8b": "llama-8b"}.get(phase, "qwen2.5-0.5b")
    argv = ["gpu", "--device", "cpu" if cpu else "cuda", "--model-shape", shape,
            "--dtype", "float32" if cpu else "bf16", "--lengths", "1024" if cpu else "8192",
            "--repeats", "1" if cpu else "3", "--no-disk", "--ingest-documents", "0",
            "--output", str(out / OUTPUTS[phase])]  # fmt: skip
    if (kit / "tokenizer").is_dir():
        argv += ["--tokenizer", str(kit / "tokenizer")]
    if phase == "compiled":  # on the CPU one graph only: compiling is minutes there
        strategies = "full,default,default@compiled,reuse,reuse@compiled"
        strategies = "full,reuse,reuse@compiled" if cpu else strategies
        return [*argv, "--no-host", "--decode-tokens", "0", "--strategies", strategies]
    return [*argv, "--decode-tokens", "16", "--strategies", "full,default,reuse"]


#: pyproject.toml's pytest options without its workers (``-n auto``): the GPU image has no
#: pytest-xdist, and the tests of one GPU run in one process.
ONE_PROCESS = ["-o", "addopts=--strict-markers -ra"]


def pytest_argv(phase: str, cpu: bool, out: Path) -> list[str]:
    """``pytest`` arguments of a tests phase (``cuda_only`` keeps the tests with a CUDA path)."""
    from kvblend.bench.gpu.suite import CUDA_TESTS, SMOKE_TESTS

    if phase == "tests":
        files = list(SMOKE_TESTS[:1]) if cpu else [t for t in CUDA_TESTS if t not in COMPILED_TESTS]
        marks = ["-m", "not slow"]
    else:  # on the CPU the quick ones only: compiling is minutes there
        files, marks = list(COMPILED_TESTS[:1]), ["-m", "not slow"] if cpu else []
    return [*ONE_PROCESS, "-p", "cuda_only", "--device", "cpu" if cpu else "cuda", "-q", "-p",
            "no:cacheprovider", f"--junitxml={out / OUTPUTS[phase]}", *marks, *files]  # fmt: skip


def environment() -> int:
    """Print the GPU (``nvidia-smi``) and the versions of what the run uses."""
    smi = shutil.which("nvidia-smi")
    if smi:
        query = ["--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]
        subprocess.run([smi, *query], check=False, timeout=30)
    import torch

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}")
    print("cuda:", torch.cuda.is_available() and torch.cuda.get_device_name())
    for name in ("transformers", "triton", "tokenizers", "numpy", "pytest", "diskcache"):
        try:
            print(name, importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            print(name, "not installed")
    return 0


def run_phase(phase: str, cpu: bool, kit: Path, out: Path, extra: list[str]) -> int:
    """Run ``phase`` in this process; return its exit code."""
    if phase == "env":
        return environment()
    if phase in ("tests", "compiled-tests"):  # pytest, a test tool: run, not imported
        argv = [sys.executable, "-m", "pytest", *pytest_argv(phase, cpu, out), *extra]
        process = subprocess.Popen(argv)
        while True:
            try:
                return process.wait()
            except KeyboardInterrupt:  # the phase's time is up: timeout signalled the group,
                continue  # pytest too, which writes its report of the tests run so far
    from kvblend.bench.cli import main as bench

    return bench([*bench_argv(phase, cpu, kit, out), *extra])


def summary(out: Path, cpu: bool) -> int:
    """Write ``summary.md`` and ``summary.json`` of the results in ``out`` (partial or not)."""
    from kvblend.bench.gpu import suite_summary as gpu_suite_summary

    lengths: dict[str, Sequence[int]] = {
        name: [1024 if cpu else 8192] for name in gpu_suite_summary.RUNS
    }
    summary = gpu_suite_summary.summarize([out], lengths, tiers=("memory", "host"))
    gpu_suite_summary.write(summary, out)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one phase (or the summary): ``python -m kvblend.bench.gpu_run PHASE [options]``.

    Options after ``--`` go to the phase's ``kvblend bench gpu`` or ``pytest``.
    """
    parser = argparse.ArgumentParser(
        prog="python -m kvblend.bench.gpu_run", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("phase", choices=(*PHASES, "summary"))
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--kit", type=Path, default=Path("gpu_kit"), help="scripts/gpu_kit.py's")
    parser.add_argument("--out", type=Path, required=True, help="the run's folder")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []  # for bench or pytest
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    args.out.mkdir(parents=True, exist_ok=True)
    cpu = args.device == "cpu"
    if args.phase == "summary":
        return summary(args.out, cpu)
    return run_phase(args.phase, cpu, args.kit, args.out, extra)


if __name__ == "__main__":
    sys.exit(main())
