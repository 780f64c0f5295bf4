"""The engine's CPU threads: a load-aware default, the process's own choice kept, ``threads=``
on the engine and on every adapter; the CLI uses the same default."""

from __future__ import annotations

import pytest
import torch

import kvblend.engine.torch_threads as threads_module
from conftest import byte_tokenizer, tiny_model
from kvblend import BlendEngine
from kvblend.engine.torch_threads import default_threads, physical_cores, use_threads
from kvblend.store import MemoryKVStore


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch):
    """A process that never chose its threads: torch's count is the one seen at import."""
    before = torch.get_num_threads()
    monkeypatch.setattr(threads_module, "_SET_BY_KVBLEND", None)
    monkeypatch.setattr(threads_module, "_TORCH_AT_IMPORT", before)
    for name in threads_module.THREAD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    yield
    torch.set_num_threads(before)


def _load(monkeypatch: pytest.MonkeyPatch, load: float, cpus: int = 4, cores: int = 4) -> None:
    monkeypatch.setattr(threads_module.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(threads_module.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(threads_module, "physical_cores", lambda: cores)


@pytest.mark.parametrize(
    ("load", "cpus", "cores", "expected"),
    [
        (0.0, 4, 4, 4),
        (1.0, 4, 4, 3),
        (3.6, 4, 4, 1),
        (9.0, 4, 4, 1),
        (0.2, 8, 4, 4),
        (1.0, 2, 2, 1),
        (0.4, 2, 2, 2),
    ],  # fmt: skip
)
def test_the_default_is_the_cores_the_load_leaves_idle(
    monkeypatch: pytest.MonkeyPatch, load: float, cpus: int, cores: int, expected: int
) -> None:
    _load(monkeypatch, load, cpus, cores)
    assert default_threads() == expected


def test_physical_cores_is_between_one_and_the_cpus() -> None:
    import os

    assert 1 <= physical_cores() <= (os.cpu_count() or 1)
    assert 1 <= default_threads() <= physical_cores()


def test_an_engine_applies_the_default_unless_the_process_chose(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _load(monkeypatch, 3.0, cpus=4, cores=4)
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    assert engine.threads == torch.get_num_threads() == 1
    _load(monkeypatch, 0.0, cpus=4, cores=4)  # an earlier engine's count stands
    assert use_threads() == 1
    assert use_threads(3) == torch.get_num_threads() == 3  # an explicit count always applies


def test_a_count_the_process_chose_is_kept(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _load(monkeypatch, 3.0, cpus=4, cores=4)
    chosen = 2 if torch.get_num_threads() != 2 else 3
    torch.set_num_threads(chosen)  # before kvblend set any
    assert use_threads() == chosen == torch.get_num_threads()


def test_omp_num_threads_is_kept(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    _load(monkeypatch, 3.0, cpus=4, cores=4)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert use_threads() == torch.get_num_threads()


@pytest.mark.parametrize(
    ("threads", "error", "message"),
    [(0, ValueError, "threads must be at least 1"), (2.0, TypeError, "threads must be an int"),
     (True, TypeError, "threads must be an int"), ("2", TypeError, "threads must be an int")],
)  # fmt: skip
def test_bad_thread_counts_are_refused_before_the_model(threads, error, message) -> None:
    with pytest.raises(error, match=message):
        BlendEngine.from_pretrained("/no/such/model", threads=threads)


def test_from_pretrained_sets_the_threads_before_loading(
    fresh: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import kvblend.engine.engine as engine_module

    seen = []

    def load_model(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(torch.get_num_threads())
        return tiny_model("llama"), byte_tokenizer()

    monkeypatch.setattr(engine_module, "load_model", load_model)
    monkeypatch.setattr(engine_module, "resolve_model", lambda model: "tiny")
    engine = BlendEngine.from_pretrained(threads=1, store=MemoryKVStore())
    assert seen == [1] and engine.threads == 1 == torch.get_num_threads()


def test_the_adapters_take_threads(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    import kvblend.integrations.shared as adapters
    from kvblend.langchain import BlendLLM, BlendRetriever, ChatBlend
    from kvblend.llamaindex import BlendLLM as IndexLLM
    from kvblend.llamaindex import BlendNodePostprocessor

    loads = []
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), threads=2)

    def from_pretrained(cls, model=None, **kwargs):  # noqa: ANN001, ANN202
        loads.append(kwargs.get("threads"))
        return engine

    monkeypatch.setattr(BlendEngine, "from_pretrained", classmethod(from_pretrained))
    monkeypatch.setattr(adapters, "_ENGINES", {})
    monkeypatch.setattr(adapters, "resolve_model", lambda model: f"spec-{model}")
    llm = BlendLLM(model="a", threads=1)
    assert llm._get_engine() is engine and loads == [1] and torch.get_num_threads() == 1
    ChatBlend(engine=engine, threads=2)._get_engine()  # given an engine: set for the process
    assert torch.get_num_threads() == 2
    assert IndexLLM(model="b", threads=1).get_engine() is engine and loads == [1, 1]
    assert torch.get_num_threads() == 1
    BlendNodePostprocessor(engine=engine, threads=2).get_engine()
    assert torch.get_num_threads() == 2
    from langchain_core.retrievers import BaseRetriever

    class Nothing(BaseRetriever):
        def _get_relevant_documents(self, query, *, run_manager):  # noqa: ANN001, ANN202
            return []

    BlendRetriever(retriever=Nothing(), engine=engine, threads=1)._get_engine()
    assert torch.get_num_threads() == 1
    for build in (lambda: BlendLLM(threads=0), lambda: IndexLLM(threads=-1)):
        with pytest.raises(ValueError, match="threads"):
            build()
