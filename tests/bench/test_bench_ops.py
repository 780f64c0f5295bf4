"""Aten ops per layer and host syncs of a prefill, counted through ``engine.prefill``.

Every aten op is a kernel launch on a GPU and every sync op a stall, so these counts bound the
GPU path's overhead; they do not depend on the model's width or the prompt's length, so a tiny
model shows them. Per-layer counts are taken as the difference between a 2- and a 4-layer
model, which cancels what a prefill does once (embedding, logits, setup).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
import torch

from kvblend.bench.cli import build_parser
from kvblend.bench.speed.ops import (
    byte_engine,
    count_prefill,
    ops_table,
    passes,
    rag_prompt,
    random_documents,
    run_ops,
)
from kvblend.blend import loop as blend_module
from kvblend.blend.config import BlendConfig
from kvblend.errors import BlendCancelledError
from kvblend.prompt.segments import Segment

DOCUMENTS = random_documents(6, 96, seed=1)


def counts(layers: int, config: BlendConfig) -> tuple[int, int, int]:
    """Ops, syncs before the logits and syncs in all of a prefill of ``layers`` layers."""
    engine = byte_engine(layers, hidden=32)
    engine.precompute([text + "\n" for text in DOCUMENTS], progress=False)
    count, result = count_prefill(engine, rag_prompt(DOCUMENTS), config)
    assert result.stats.moved_tokens > 0 or config.strategy == "full"
    assert count.syncs_before_logits is not None  # the logits were computed, and seen
    return count.ops, count.syncs_before_logits, count.syncs


@pytest.mark.parametrize(
    ("config", "per_layer", "syncs"),
    [
        (BlendConfig("reuse"), 18, 0),
        (BlendConfig(), 28, 1),  # the default: its chosen rows read for the stats, after
        (BlendConfig(early_layers=0.5, min_recompute=0), 28, 1),  # the funnel narrows
        (BlendConfig(probe_layers=0.5), 28, 1),  # a probe over the first half of the layers
        (BlendConfig("epic"), 27, 0),
        (BlendConfig("full"), 18, 0),
    ],
    ids=["reuse", "default", "funnel", "short-probe", "epic", "full"],
)
def test_ops_per_layer_and_syncs_per_prefill(
    config: BlendConfig, per_layer: int, syncs: int
) -> None:
    """No host sync before the logits, whatever the strategy but CacheBlend on the CPU; the
    rows chosen on the device are read once after them, for the statistics."""
    small_ops, small_before, small_syncs = counts(2, config)
    large_ops, large_before, large_syncs = counts(4, config)
    ops_per_layer_pass = (large_ops - small_ops) / (2 * passes(config))
    assert 0 < ops_per_layer_pass <= per_layer
    assert small_before == large_before == 0
    assert small_syncs == large_syncs == syncs  # none of them in the layer loop


def test_the_counter_sees_syncs() -> None:
    """The counter is not blind: CacheBlend's rows, chosen on the device at its check layer
    with no bounds the host knows, are read back for the CPU's query chunks (not with flex)."""
    ops, before, syncs = counts(2, BlendConfig("cacheblend"))
    assert before == syncs == 1


def test_bench_ops_command(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(
        ["ops", "--layers", "2", "--hidden", "32", "--documents", "3", "--doc-tokens", "40",
         "--strategies", "reuse,default,default+early_layers=0.5"]
    )  # fmt: skip
    args.func(args)
    out = capsys.readouterr().out
    assert "| reuse |" in out and "| default |" in out and "| default+early_layers=0.5 |" in out
    rows = run_ops(byte_engine(2, hidden=32), 3, 40, ["reuse"])
    assert rows[0]["syncs"] == 0 and "| reuse |" in ops_table(rows)


def test_a_cancelled_prefill_stops_between_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = byte_engine(6, hidden=32)
    engine.precompute([text + "\n" for text in DOCUMENTS], progress=False)
    engine.prefill(rag_prompt(DOCUMENTS), BlendConfig("reuse"))  # stores the prompt head
    cancel = threading.Event()
    layers_run: list[int] = []
    real = blend_module.compute_layer

    def counting(state, layer, *args):  # type: ignore[no-untyped-def]
        layers_run.append(layer)
        if len(layers_run) == 2:
            cancel.set()
        return real(state, layer, *args)

    monkeypatch.setattr(blend_module, "compute_layer", counting)
    with pytest.raises(BlendCancelledError):
        engine.prefill(rag_prompt(DOCUMENTS), BlendConfig("reuse"), cancel=cancel)
    assert layers_run == [0, 1]  # stopped before the third layer
    layers_run.clear()
    cancel.clear()
    with pytest.raises(BlendCancelledError):
        engine.generate(rag_prompt(DOCUMENTS), BlendConfig(), cancel=cancel)
    assert len(layers_run) == 2  # within the probe pass, before the main one
    monkeypatch.undo()
    result = engine.prefill(rag_prompt(DOCUMENTS), BlendConfig(), cancel=threading.Event())
    assert torch.isfinite(result.logits).all()


@pytest.mark.parametrize("streaming", [False, True], ids=["invoke", "stream"])
def test_a_cancelled_async_request_stops_within_one_layer(
    monkeypatch: pytest.MonkeyPatch, streaming: bool
) -> None:
    """The adapters' async paths (`run_in_thread`, `iterate_in_thread`) hand the engine a
    cancel event that is set when the awaiting task is cancelled."""
    from kvblend.integrations import background, runs

    engine = byte_engine(6, hidden=32)
    engine.precompute([text + "\n" for text in DOCUMENTS], progress=False)
    prompt = rag_prompt(DOCUMENTS)
    engine.prefill(prompt, BlendConfig("reuse"))  # stores the prompt head
    started, released, finished = threading.Event(), threading.Event(), threading.Event()
    layers_run: list[int] = []
    real = blend_module.compute_layer

    def blocking(state, layer, *args):  # type: ignore[no-untyped-def]
        layers_run.append(layer)
        if layer == 0:
            started.set()
            released.wait(10)
        return real(state, layer, *args)

    monkeypatch.setattr(blend_module, "compute_layer", blocking)
    options = {"max_new_tokens": 4}

    def work() -> None:
        try:
            if streaming:
                list(runs.stream_prompt(engine, prompt, BlendConfig("reuse"), options))
            else:
                runs.run_prompt(engine, prompt, BlendConfig("reuse"), options)
        finally:
            finished.set()

    def pieces() -> Iterator[None]:
        work()
        yield None

    async def request() -> None:
        if streaming:
            async for _ in background.iterate_in_thread(pieces):
                pass
        else:
            await background.run_in_thread(work)

    async def main() -> None:
        task = asyncio.create_task(request())
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        released.set()
        await asyncio.get_running_loop().run_in_executor(None, finished.wait, 10)

    asyncio.run(main())
    assert finished.is_set()
    assert layers_run == [0]  # the layer running when cancelled, and no other


def test_bench_plan_times_the_tokenizer_and_the_plan() -> None:
    from conftest import byte_tokenizer
    from kvblend.bench.speed.planning import planning_line, run_planning, tokenizer_engine

    engine = tokenizer_engine(byte_tokenizer())
    result = run_planning(engine, prompt_tokens=600, doc_tokens=150, repeats=2)
    assert result["documents"] == 4 and result["documents_found"] == 4
    assert result["tokenizer_s"] > 0 and result["plan_s"] > 0
    assert "x the tokenizer" in planning_line(result)


@pytest.mark.parametrize("config", [BlendConfig("reuse"), BlendConfig()], ids=["reuse", "default"])
def test_no_host_sync_before_the_logits_from_the_memory_tier_first_read_included(
    config: BlendConfig,
) -> None:
    """The whole prefill counted, from the first read of every document's entry on: the memory
    tier checked their values as they were written, so reading them waits on nothing."""
    engine = byte_engine(2, hidden=32)
    engine.precompute([text + "\n" for text in DOCUMENTS], progress=False)
    head = Segment("Answer from the documents.\n", role="prefix")  # stored, not the documents
    engine.prefill([head, Segment("Question: none?", cache=False)], BlendConfig("reuse"))
    count, result = count_prefill(engine, rag_prompt(DOCUMENTS), config, whole=True)
    assert result.stats.segments_cached == len(DOCUMENTS) + 1
    assert result.stats.segments_precomputed == 0  # every entry served by the memory tier
    assert count.syncs_before_logits == 0, count.sync_ops
