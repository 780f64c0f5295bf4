"""The connector's worker side under tensor parallelism, without vLLM: two ranks in two threads.

`_RankAdapter` is one tensor-parallel rank of the tiny Llama (4 query heads, 2 KV heads): its
query and KV heads are its share of the model's, its ``o_proj`` is the matching columns, and
the partial outputs are summed across the ranks (as vLLM's row-parallel layers all-reduce), so
is every selection score (`reduce_scores`). Each rank runs its own blends (`blending.run_job`)
over the same store; together they must write, head by head, what one process writes.
"""

from __future__ import annotations

import copy
import logging
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.blend.adapter import DecoderShape
from kvblend.models.decoder import Decoder
from kvblend.prompt.segments import segment_key
from kvblend.store import MemoryKVStore
from kvblend.vllm.execution.blending import WorkerModel, gate, run_job
from kvblend.vllm.request_plan import plan_request
from kvblend.vllm.requests import BlendJob, BlendOutcome, WorkerReport
from test_vllm_sides import BLOCK, TOY, _document, _PagedLayer, _prompt, _worker

RANKS = 2


class _Group:
    """The ranks' collective: a sum over every rank, added in rank order (the same on each)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=60)
        self.parts: list[Any] = [None] * size

    def all_reduce(self, rank: int, tensor: torch.Tensor) -> torch.Tensor:
        self.parts[rank] = tensor
        self.barrier.wait()
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        self.barrier.wait()
        return total


class _RankAdapter:
    """Rank ``rank`` of ``RANKS`` of a transformers decoder: its heads, o_proj summed across."""

    def __init__(self, decoder: Decoder, rank: int, group: _Group) -> None:
        self.decoder, self.group = decoder, group
        shape = decoder.shape
        self.heads, self.kv = shape.num_heads // RANKS, shape.num_kv_heads // RANKS
        self.shape = DecoderShape(
            shape.num_layers, self.heads, self.kv, shape.head_dim, shape.max_positions
        )
        self.windows, self.scaling = decoder.windows, decoder.scaling
        self.has_qk_norm, self.device, self.dtype = False, decoder.device, decoder.dtype
        self.tp_rank, self.tp_size = rank, RANKS
        self.kv_heads = slice(rank * self.kv, (rank + 1) * self.kv)
        self.embed, self.rotary = decoder.embed, decoder.rotary
        self.feed_forward, self.logits = decoder.feed_forward, decoder.logits
        self.attention_layers = [
            _PagedLayer(self.kv, shape.head_dim, 64) for _ in range(shape.num_layers)
        ]
        self.score_sums = 0

    def project_rows(self, layer: int, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        queries, kv = self.decoder.project_rows(layer, hidden)
        rank = self.tp_rank
        return queries[rank * self.heads : (rank + 1) * self.heads], kv[:, :, self.kv_heads]

    def project_kv(self, layer: int, hidden: torch.Tensor, *, keys: bool) -> torch.Tensor:
        return self.decoder.project_kv(layer, hidden, keys=keys)[self.kv_heads]

    def attention_output(self, layer: int, attended: torch.Tensor) -> torch.Tensor:
        weight = self.decoder.layers[layer].self_attn.o_proj.weight
        width = self.heads * self.shape.head_dim
        columns = weight[:, self.tp_rank * width : (self.tp_rank + 1) * width]
        return self.group.all_reduce(self.tp_rank, attended @ columns.T)

    def reduce_scores(self, scores: torch.Tensor) -> torch.Tensor:
        self.score_sums += 1
        return self.group.all_reduce(self.tp_rank, scores)

    def gather_ranks(self, values: torch.Tensor) -> torch.Tensor:
        rows = torch.zeros(RANKS, values.numel())
        rows[self.tp_rank] = values.float()
        return self.group.all_reduce(self.tp_rank, rows)


def _on_ranks(run: Callable[[int], Any]) -> list[Any]:
    """Run ``run(rank)`` on every rank at once (threads); return each rank's result."""
    results: list[Any] = [None] * RANKS
    errors: list[BaseException] = []

    def target(rank: int) -> None:
        try:
            results[rank] = run(rank)
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=target, args=(rank,)) for rank in range(RANKS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return results


@pytest.fixture(scope="module")
def setup() -> tuple[BlendEngine, list[str]]:
    torch.set_num_threads(1)
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    rng = random.Random(11)
    documents = [_document(rng, 30) for _ in range(4)]
    engine.precompute(documents)
    return engine, documents


def _ranks(engine: BlendEngine) -> tuple[list[WorkerModel], _Group]:
    group = _Group(RANKS)
    adapters = [_RankAdapter(engine.decoder, rank, group) for rank in range(RANKS)]
    return [WorkerModel(a, engine.library, BLOCK) for a in adapters], group  # type: ignore[arg-type]


def _job(engine: BlendEngine, documents: list[str], config: BlendConfig) -> BlendJob:
    ids = engine.encode(_prompt(engine, documents[::-1]))
    plan = plan_request(engine.library, ids, 0, config)
    assert plan.fallback is None
    return BlendJob("r", plan.plan, config, 0, len(ids) - 1, list(range(1, len(ids) // BLOCK + 2)))


@pytest.mark.parametrize("strategy", ["attention", "cacheblend"])
def test_each_rank_writes_its_heads_of_what_one_process_writes(
    setup: tuple[BlendEngine, list[str]], strategy: str
) -> None:
    engine, documents = setup
    config = BlendConfig(**TOY) if strategy == "attention" else BlendConfig("cacheblend")
    job = _job(engine, documents, config)
    single, layers = _worker(engine)
    alone = run_job(single, job)
    assert alone.error is None and 0 < alone.recomputed < alone.reused + alone.recomputed
    workers, _ = _ranks(engine)
    outcomes = _on_ranks(lambda rank: run_job(workers[rank], job))
    for rank, outcome in enumerate(outcomes):
        assert outcome.error is None and not outcome.lost, outcome
        assert (outcome.reused, outcome.recomputed) == (alone.reused, alone.recomputed)
        adapter = workers[rank].adapter
        assert adapter.score_sums == 1  # one all-reduce per selection
        for mine, whole in zip(adapter.attention_layers, layers, strict=True):
            torch.testing.assert_close(
                mine.kv_cache[1:], whole.kv_cache[1:, :, :, adapter.kv_heads], atol=1e-5, rtol=1e-4
            )


def test_ranks_agree_on_the_entries_they_use(setup: tuple[BlendEngine, list[str]]) -> None:
    """An entry one rank cannot read is computed on every rank (else their rows would differ)."""
    engine, documents = setup
    job = _job(engine, documents, BlendConfig(**TOY))
    workers, _ = _ranks(engine)
    segment_kv = copy.copy(engine.library.segment_kv)  # rank 1's reads: the first entry missing
    real, first = segment_kv.open_entry, job.plan.spans[0]
    first_key = segment_key(segment_kv.fingerprint, first.context_ids, first.cached_ids)

    def missing_first(key: str, tokens: int, device: Any = None) -> Any:
        return None if key == first_key else real(key, tokens, device)

    segment_kv.open_entry = missing_first  # type: ignore[method-assign]
    library = copy.copy(engine.library)
    library.segment_kv = segment_kv
    workers[1] = workers[1]._replace(library=library)
    outcomes = _on_ranks(lambda rank: run_job(workers[rank], job))
    assert outcomes[0].reused == outcomes[1].reused
    assert outcomes[0].recomputed == outcomes[1].recomputed
    assert any("another tensor-parallel rank" in line for line in outcomes[0].lost)
    alone, _ = _worker(engine)
    full = run_job(alone, _job(engine, documents, BlendConfig(**TOY)))
    assert outcomes[0].reused < full.reused


def test_a_failed_blend_is_not_run_again_on_a_rank(setup: tuple[BlendEngine, list[str]]) -> None:
    """A rank never runs a pass alone: its request is a failed load, which vLLM computes."""
    engine, documents = setup
    job = _job(engine, documents, BlendConfig(**TOY))
    job.block_ids = job.block_ids[:1]  # too few blocks: the write fails after the loop
    workers, _ = _ranks(engine)
    outcomes = _on_ranks(lambda rank: run_job(workers[rank], job))
    for outcome in outcomes:
        assert outcome.failed and "not run again under tensor parallelism" in str(outcome.error)


def test_the_gate_verdict_is_the_same_on_every_rank(setup: tuple[BlendEngine, list[str]]) -> None:
    engine, _ = setup
    workers, _ = _ranks(engine)

    def forward(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return engine.model(torch.tensor([ids])).logits[0, -1].float()

    verdicts = _on_ranks(lambda rank: gate(workers[rank], forward))
    assert all(passed for passed, _ in verdicts) and verdicts[0] == verdicts[1], verdicts
    # one rank's reference is off: both refuse, with the same worst error
    verdicts = _on_ranks(
        lambda rank: gate(workers[rank], lambda ids: forward(ids) * (1.5 if rank else 1.0))
    )
    assert not any(passed for passed, _ in verdicts) and verdicts[0] == verdicts[1], verdicts
    assert "does not reproduce" in verdicts[0][1]


def test_a_rank_stores_no_document_and_says_why_once(
    setup: tuple[BlendEngine, list[str]], caplog: pytest.LogCaptureFixture
) -> None:
    from kvblend.vllm.execution.worker import Worker
    from kvblend.vllm.requests import StepMetadata
    from kvblend.vllm.settings import ConnectorSettings

    engine, _ = setup
    workers, _ = _ranks(engine)
    worker = Worker(ConnectorSettings(parity=False, when="always"), None, None)
    worker.register(lambda: workers[0])
    stored = len(list(engine.store.keys()))
    with caplog.at_level(logging.WARNING, logger="kvblend"):
        worker.start(StepMetadata(store=[("A new document, not stored.", "context")]))
        worker.start(StepMetadata(store=[("Another one, not stored.", "context")]))
    said = [r.getMessage() for r in caplog.records if "tensor_parallel_size=2" in r.getMessage()]
    assert len(said) == 1 and "kvblend precompute" in said[0]
    assert len(list(engine.store.keys())) == stored


def test_the_ranks_reports_keep_one_outcome_per_request() -> None:
    fine, fell_back = BlendOutcome("r", reused=5), BlendOutcome("r", error="boom")
    merged = WorkerReport((True, "ok"), [fine, BlendOutcome("s")]).aggregate(
        WorkerReport((True, "ok"), [fell_back, BlendOutcome("s")])
    )
    assert sorted(o.request_id for o in merged.outcomes) == ["r", "s"]
    assert next(o for o in merged.outcomes if o.request_id == "r") is fell_back


@pytest.mark.parametrize(
    "kv, ranks, held",
    [
        (3, 3, [(0, 1), (1, 2), (2, 3)]),  # SmolLM2 at tensor_parallel_size=3
        (8, 2, [(0, 4), (4, 8)]),
        (3, 9, [(0, 1)] * 3 + [(1, 2)] * 3 + [(2, 3)] * 3),  # fewer KV heads than ranks
        (2, 4, [(0, 1), (0, 1), (1, 2), (1, 2)]),
    ],
)
def test_each_rank_reads_the_kv_heads_vllm_gives_it(
    kv: int, ranks: int, held: list[tuple[int, int]]
) -> None:
    from kvblend.vllm.execution.adapter import rank_kv_heads

    local, replicas = max(kv // ranks, 1), max(ranks // kv, 1)  # as QKVParallelLinear
    got = [rank_kv_heads(rank, local, replicas) for rank in range(ranks)]
    assert [(heads.start, heads.stop) for heads in got] == held
