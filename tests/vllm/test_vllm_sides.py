"""The connector's two sides without vLLM: planning, claims and counts; blending into a paged cache.

`kvblend.vllm.planning` and `kvblend.vllm.scheduler` decide from token ids alone; they are
checked here against the engine's own forecast (`BlendEngine.explain`) over tiny models.
`kvblend.vllm.worker.WorkerSide` runs the blend loop through any model adapter; here a
transformers `Decoder` stands in for vLLM's modules and a toy paged cache for vLLM's, and the K/V
it writes is checked against transformers' own cache of the same prompt. `tests/vllm/test_vllm.py`
checks the same code inside vLLM.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.prompt.plan import TokenKind
from kvblend.store import MemoryKVStore
from kvblend.vllm.planning import plan_request, restrict
from kvblend.vllm.scheduler import KVBlendWorkerMeta, SchedulerSide
from kvblend.vllm.settings import ConnectorSettings, request_config
from kvblend.vllm.worker import BlendJob, WorkerSide

WORDS = "alpha beta gamma delta river stone cloud maple copper violin lisbon harbor".split()
TOY = {"short_document": 0, "min_recompute": 0, "full_above": 1.0}


def _document(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words)).capitalize() + "."


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    return BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())


@pytest.fixture(scope="module")
def documents(engine: BlendEngine) -> list[str]:
    rng = random.Random(7)
    texts = [_document(rng, 30) for _ in range(4)]
    engine.precompute(texts)
    return texts


def _prompt(engine: BlendEngine, documents: list[str], question: str = "Which stone?") -> str:
    return "".join(segment.text for segment in engine.rag_segments(question, documents))


def test_a_plan_claims_all_but_the_last_token_and_counts_as_the_engine(
    engine: BlendEngine, documents: list[str]
) -> None:
    config = BlendConfig(**TOY)
    prompt = _prompt(engine, documents[::-1])
    ids = engine.encode(prompt)
    plan = plan_request(engine.library, ids, 0, config)
    explained = engine.explain(prompt, config)
    assert plan.fallback is None
    assert plan.claimed == len(ids) - 1
    assert plan.reused == explained.reused_tokens > 0
    assert plan.recomputed == explained.recomputed_tokens
    assert plan.summary()["cached_tokens"] == plan.reused


def test_rows_in_vllms_prefix_cache_are_computed_by_the_blend_not_claimed(
    engine: BlendEngine, documents: list[str]
) -> None:
    prompt = _prompt(engine, documents)
    ids = engine.encode(prompt)
    start = 16
    plan = plan_request(engine.library, ids, start, BlendConfig(**TOY))
    assert plan.claimed == len(ids) - 1 - start
    assert all(kind == TokenKind.COMPUTE for kind in plan.plan.kinds[:start])
    assert all(span.start >= start for span in plan.plan.spans)
    moved = sum(kind != TokenKind.COMPUTE for kind in plan.plan.kinds)
    assert plan.reused == start + moved - plan.recomputed


def test_a_long_prefix_hit_leaves_the_prompt_to_vllm(
    engine: BlendEngine, documents: list[str]
) -> None:
    ids = engine.encode(_prompt(engine, documents))
    last = plan_request(engine.library, ids, 0, BlendConfig(**TOY)).plan.spans[-1]
    plan = plan_request(engine.library, ids, last.start + 3, BlendConfig(**TOY))
    assert plan.claimed == 0 and "prefix cache" in str(plan.fallback)
    whole = plan_request(engine.library, ids, len(ids) - 1, BlendConfig(**TOY))
    assert whole.claimed == 0


def test_missing_entries_are_computed_and_listed_to_be_stored(documents: list[str]) -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute(documents[:2])
    engine.register(documents[2:3])  # known, never computed
    prompt = _prompt(engine, [documents[2], documents[1], documents[0]])
    plan = plan_request(engine.library, engine.encode(prompt), 0, BlendConfig(**TOY))
    assert plan.fallback is None
    assert [text for text, _ in plan.missing] == [documents[2]]
    assert len(plan.plan.spans) == 2
    lost = [row for row in plan.plan.report if row.role == "document" and row.span is None]
    assert len(lost) == 1 and "not in the store" in lost[0].reason


def test_a_store_that_fails_is_a_miss(documents: list[str], engine: BlendEngine) -> None:
    class Broken(MemoryKVStore):
        def contains(self, key: str) -> bool:
            raise OSError("store down")

    library = engine.library
    real = library.store
    library.store = Broken()
    try:
        ids = engine.encode(_prompt(engine, documents))
        plan = plan_request(library, ids, 0, BlendConfig(**TOY))
    finally:
        library.store = real
    assert plan.claimed == 0 and plan.fallback == "no stored document left to reuse"


def test_token_ids_that_are_not_the_texts_tokenization_are_not_blended() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)} | {"ab": len(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    canonical = tokenizer("cab")["input_ids"]
    assert len(canonical) == 2
    library = SimpleNamespace(segment_kv=SimpleNamespace(tokenizer=tokenizer))
    split = [vocab["c"], vocab["a"], vocab["b"]]  # "cab" too, but not as the tokenizer cuts it
    plan = plan_request(library, split, 0, BlendConfig(**TOY))
    assert plan.claimed == 0 and "not the tokenization" in str(plan.fallback)


def test_the_budget_rule_falls_back_with_the_engines_reason(
    engine: BlendEngine, documents: list[str]
) -> None:
    prompt = _prompt(engine, documents[:2][::-1])
    plan = plan_request(engine.library, engine.encode(prompt), 0, BlendConfig())
    explained = engine.explain(prompt, BlendConfig())
    assert explained.fallback is not None
    assert plan.claimed == 0 and plan.fallback == explained.fallback


def test_full_claims_every_row_and_reuses_nothing(
    engine: BlendEngine, documents: list[str]
) -> None:
    ids = engine.encode(_prompt(engine, documents))
    plan = plan_request(engine.library, ids, 0, BlendConfig("full"))
    assert plan.claimed == len(ids) - 1 and plan.reused == 0 and plan.fallback is None


def test_restrict_drops_spans_and_clips_them_at_the_prefix_hit(
    engine: BlendEngine, documents: list[str]
) -> None:
    prompt = _prompt(engine, documents[:3])
    base = plan_request(engine.library, engine.encode(prompt), 0, BlendConfig(**TOY)).plan
    first, second = base.spans[0], base.spans[1]
    start = first.start + 3
    plan = restrict(base, start, {1}, "gone")
    assert plan.spans[0].start == start
    assert plan.spans[0].cached_start == first.cached_start + 3
    assert all(kind == TokenKind.COMPUTE for kind in plan.kinds[second.start : second.end])
    assert [row.reason for row in plan.report if row.span is None and row.role == "document"] == [
        "gone"
    ]
    assert plan.kinds[-1] == TokenKind.COMPUTE


def test_settings_and_request_choices() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"strategy": "epic", "settings": {"epic_tokens": 4}}
    )
    assert settings.config == BlendConfig("epic", epic_tokens=4)
    with pytest.raises(ValueError, match="no setting 'stratgy'"):
        ConnectorSettings.from_extra_config({"stratgy": "full"})
    default = BlendConfig()
    assert request_config(default, None) is default
    assert request_config(default, {"kvblend": False}) is None
    assert request_config(default, {"kvblend": {"strategy": "full"}}) == BlendConfig("full")
    with pytest.raises(ValueError):
        request_config(default, {"kvblend": {"no_such_setting": 1}})


# ---------------------------------------------------------------- scheduler side


def _request(request_id: str, ids: list[int], **fields: Any) -> SimpleNamespace:
    stats = SimpleNamespace(
        num_prompt_tokens=len(ids), num_cached_tokens=0, num_computed_tokens=len(ids),
        num_local_cached_tokens=0, num_external_cached_tokens=0,
    )  # fmt: skip
    values = dict(
        request_id=request_id, prompt_token_ids=ids, num_preemptions=0,
        sampling_params=SimpleNamespace(prompt_logprobs=None), lora_request=None,
        mm_features=[], kv_transfer_params=None, prefill_stats=stats,
    )  # fmt: skip
    values.update(fields)
    return SimpleNamespace(**values)


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


def test_the_scheduler_waits_for_the_gate_then_claims_and_reports(
    engine: BlendEngine, documents: list[str]
) -> None:
    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY)), engine.library)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("r1", ids)
    assert side.matched(request, 0) == (None, False)  # no verdict yet: asked again
    side.worker_output(KVBlendWorkerMeta(verdict=(True, "passed")))
    claimed, asynchronous = side.matched(request, 0)
    assert claimed == len(ids) - 1 and not asynchronous
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    reused = engine.explain(engine.tokenizer.decode(ids), BlendConfig(**TOY)).reused_tokens
    assert request.prefill_stats.num_cached_tokens == reused
    assert request.prefill_stats.num_computed_tokens == len(ids) - reused
    meta = side.metadata(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r1")]))
    (job,) = meta.jobs
    assert (job.start, job.stop, job.block_ids) == (0, len(ids) - 1, list(range(1, 9)))
    assert side.metadata(SimpleNamespace(scheduled_new_reqs=[])).jobs == []
    params = side.finished(request)
    assert params is not None and params["kvblend"]["cached_tokens"] == reused


def test_a_blend_that_reused_less_reports_its_true_count(
    engine: BlendEngine, documents: list[str]
) -> None:
    from kvblend.vllm.worker import BlendOutcome

    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY), parity=False), engine.library)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("r2", ids)
    claimed, _ = side.matched(request, 0)
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    assert request.prefill_stats.num_cached_tokens > 0
    lost = BlendOutcome("r2", reused=0, lost=["entry 0123 unusable (checksum mismatch)"])
    side.worker_output(KVBlendWorkerMeta(outcomes=[lost]))
    assert request.prefill_stats.num_cached_tokens == 0
    assert request.prefill_stats.num_computed_tokens == len(ids)
    params = side.finished(request)
    assert params is not None and params["kvblend"]["cached_tokens"] == 0
    assert params["kvblend"]["lost"] == lost.lost


def test_a_request_finished_with_its_first_token_gets_its_blend_record(
    engine: BlendEngine, documents: list[str]
) -> None:
    """max_tokens=1: vLLM asks for the record before the worker's outcome has come back."""
    from kvblend.vllm.worker import BlendOutcome

    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY), parity=False), engine.library)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("r3", ids)
    claimed, _ = side.matched(request, 0)
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    side.metadata(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="r3")]))
    params = side.finished(request)  # the step's outputs are built before the outcome is read
    assert params is not None and "blend_s" not in params["kvblend"]
    assert side.take_counts()["requests"] == 0  # not final yet
    side.worker_output(KVBlendWorkerMeta(outcomes=[BlendOutcome("r3", reused=5, blend_s=0.25)]))
    assert params["kvblend"]["blend_s"] == 0.25  # the same record object, completed
    counts = side.take_counts()
    assert counts["requests"] == counts["blended"] == 1
    assert counts["cached_tokens"] == params["kvblend"]["cached_tokens"]


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"num_preemptions": 1}, "preemption"),
        ({"kv_transfer_params": {"kvblend": False}}, "off"),
        ({"sampling_params": SimpleNamespace(prompt_logprobs=5)}, "logprobs"),
        ({"kv_transfer_params": {"kvblend": {"strategy": "nope"}}}, "planning failed"),
    ],
)
def test_requests_vllm_must_prefill_itself_are_not_claimed(
    engine: BlendEngine, documents: list[str], fields: dict[str, Any], reason: str
) -> None:
    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY), parity=False), engine.library)
    request = _request("r", engine.encode(_prompt(engine, documents)), **fields)
    assert side.matched(request, 0) == (0, False)
    side.allocated(request, _Blocks([1]), 0)
    params = side.finished(request)
    assert params is not None and reason in params["kvblend"]["fallback"]


def test_a_request_resumed_after_preemption_is_not_claimed_again(
    engine: BlendEngine, documents: list[str]
) -> None:
    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY), parity=False), engine.library)
    request = _request("r4", engine.encode(_prompt(engine, documents[::-1])))
    claimed, _ = side.matched(request, 0)
    assert claimed > 0
    request.num_preemptions = 1  # preempted: its blocks were freed, vLLM starts it over
    assert side.matched(request, 0) == (0, False)


def _scheduled(*request_ids: str) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=i) for i in request_ids])


def test_a_request_cancelled_mid_blend_leaves_no_state(
    engine: BlendEngine, documents: list[str]
) -> None:
    """vLLM frees an aborted request between steps: its blend's outcome may come after."""
    from kvblend.vllm.worker import BlendOutcome

    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY), parity=False), engine.library)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("c1", ids)
    claimed, _ = side.matched(request, 0)
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    (job,) = side.metadata(_scheduled("c1")).jobs  # the worker blends it in this step
    params = side.finished(request)  # aborted while the step runs
    assert (
        params is not None
        and params["kvblend"]["cached_tokens"] == request.prefill_stats.num_cached_tokens
    )
    assert side.tracked() == {"c1"}  # only until the outcome arrives
    side.worker_output(KVBlendWorkerMeta(outcomes=[BlendOutcome("c1", reused=3, blend_s=0.5)]))
    assert side.tracked() == set()
    assert side.take_counts()["requests"] == 1
    assert side.metadata(_scheduled("c1")).jobs == []  # nothing is ever blended for it again


@pytest.mark.parametrize("when", ["waiting for the gate", "planned", "allocated"])
def test_a_request_cancelled_before_its_blend_leaves_no_state(
    engine: BlendEngine, documents: list[str], when: str
) -> None:
    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY)), engine.library)
    request = _request("c2", engine.encode(_prompt(engine, documents[::-1])))
    if when != "waiting for the gate":
        side.worker_output(KVBlendWorkerMeta(verdict=(True, "passed")))
    claimed, _ = side.matched(request, 0)
    if when == "allocated":
        side.allocated(request, _Blocks(list(range(1, 9))), claimed or 0)
    side.finished(request)
    assert side.tracked() == set()
    assert side.metadata(_scheduled("c2")).jobs == []


def test_a_preempted_request_keeps_its_first_record_and_is_not_claimed_again(
    engine: BlendEngine, documents: list[str]
) -> None:
    from kvblend.vllm.worker import BlendOutcome

    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY), parity=False), engine.library)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("p1", ids)
    claimed, _ = side.matched(request, 0)
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    side.metadata(_scheduled("p1"))
    side.worker_output(KVBlendWorkerMeta(outcomes=[BlendOutcome("p1", reused=7, blend_s=0.5)]))
    cached = request.prefill_stats.num_cached_tokens
    assert cached > 0
    request.num_preemptions = 1  # vLLM freed its blocks; the request waits again
    assert side.matched(request, 16) == (0, False)  # its prefix-cache hit: vLLM's own
    side.allocated(request, _Blocks(list(range(20, 28))), 0)
    assert side.metadata(_scheduled("p1")).jobs == []
    assert request.prefill_stats.num_cached_tokens == cached  # what vLLM reported, unchanged
    params = side.finished(request)
    assert params is not None
    record = params["kvblend"]
    assert record["preemptions"] == 1 and record["fallback"] is None
    assert record["cached_tokens"] == cached and record["strategy"] == "attention"
    assert side.tracked() == set()
    counts = side.take_counts()
    assert counts["blended"] == 1 and counts["vllm"] == 0


def test_a_failed_gate_claims_nothing(engine: BlendEngine, documents: list[str]) -> None:
    side = SchedulerSide(ConnectorSettings(config=BlendConfig(**TOY)), engine.library)
    side.worker_output(KVBlendWorkerMeta(verdict=(False, "does not reproduce vLLM")))
    request = _request("r", engine.encode(_prompt(engine, documents)))
    assert side.matched(request, 0) == (0, False)


# ---------------------------------------------------------------- worker side

BLOCK = 16


class _PagedLayer:
    """A stand-in for a vLLM attention layer: a paged cache and the backend's write op."""

    def __init__(self, kv_heads: int, head_dim: int, blocks: int) -> None:
        self.kv_cache = torch.zeros(blocks, 2, BLOCK, kv_heads, head_dim)
        self.impl = self

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        flat = cache.view(cache.shape[0], 2, BLOCK, -1)
        for row, slot in enumerate(slots.tolist()):
            flat[slot // BLOCK, 0, slot % BLOCK] = key[row].reshape(-1)
            flat[slot // BLOCK, 1, slot % BLOCK] = value[row].reshape(-1)

    def read(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_cache[slot // BLOCK, 0, slot % BLOCK], self.kv_cache[
            slot // BLOCK, 1, slot % BLOCK
        ]


def _worker(engine: BlendEngine) -> tuple[WorkerSide, list[_PagedLayer]]:
    shape = engine.decoder.shape
    layers = [_PagedLayer(shape.num_kv_heads, shape.head_dim, 64) for _ in range(shape.num_layers)]
    decoder: Any = engine.decoder  # as `VLLMAdapter` without tensor parallelism
    decoder.attention_layers, decoder.tp_size = layers, 1
    decoder.kv_heads = slice(0, shape.num_kv_heads)
    decoder.gather_ranks = lambda values: values.float().reshape(1, -1)
    return WorkerSide(engine.decoder, engine.library, BLOCK), layers  # type: ignore[arg-type]


def _reference_kv(engine: BlendEngine, ids: list[int]) -> Any:
    with torch.inference_mode():
        out = engine.model(torch.tensor([ids]), use_cache=True)
    return out.past_key_values


def test_full_writes_the_models_own_kv_into_the_paged_cache(
    engine: BlendEngine, documents: list[str]
) -> None:
    worker, layers = _worker(engine)
    ids = engine.encode(_prompt(engine, documents))
    plan = plan_request(engine.library, ids, 0, BlendConfig("full"))
    blocks = list(range(10, 10 + len(ids) // BLOCK + 1))[::-1]  # any blocks, any order
    start = 5
    job = BlendJob("r", plan.plan, BlendConfig("full"), start, len(ids) - 1, blocks)
    outcome = worker.run(job)
    assert outcome.error is None and not outcome.failed
    cache = _reference_kv(engine, ids)
    for layer, paged in enumerate(layers):
        keys, values = cache.layers[layer].keys[0], cache.layers[layer].values[0]
        for position in (start, start + 1, len(ids) // 2, len(ids) - 2):
            slot = blocks[position // BLOCK] * BLOCK + position % BLOCK
            key, value = paged.read(slot)
            torch.testing.assert_close(key, keys[:, position], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(value, values[:, position], atol=1e-5, rtol=1e-4)
        before = blocks[(start - 1) // BLOCK] * BLOCK + (start - 1) % BLOCK
        assert not paged.read(before)[0].any()  # vLLM's own prefix rows are left alone
        after = blocks[(len(ids) - 1) // BLOCK] * BLOCK + (len(ids) - 1) % BLOCK
        assert not paged.read(after)[0].any()  # the last token is vLLM's to compute


def test_a_damaged_entry_is_computed_in_full(documents: list[str]) -> None:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    engine.precompute(documents[:2])
    worker, layers = _worker(engine)
    prompt = _prompt(engine, documents[:2][::-1])
    ids = engine.encode(prompt)
    plan = plan_request(engine.library, ids, 0, BlendConfig(**TOY))
    assert plan.fallback is None
    for key in list(engine.store.keys()):  # every entry now holds a wrong shape: unusable
        engine.store.put(key, {"kv": torch.zeros(1, 2, 3)}, {})
    blocks = list(range(1, len(ids) // BLOCK + 2))
    outcome = worker.run(BlendJob("r", plan.plan, BlendConfig(**TOY), 0, len(ids) - 1, blocks))
    assert len(outcome.lost) == 2 and outcome.reused == 0 and outcome.error is None
    cache = _reference_kv(engine, ids)  # every row computed: the model's own KV
    position = len(ids) - 2
    key, _ = layers[-1].read(blocks[position // BLOCK] * BLOCK + position % BLOCK)
    torch.testing.assert_close(key, cache.layers[-1].keys[0][:, position], atol=1e-5, rtol=1e-4)


def test_blocks_of_a_cancelled_request_get_the_next_requests_own_kv(
    engine: BlendEngine, documents: list[str]
) -> None:
    """vLLM hands a freed request's blocks to another: every row written is the new one's."""
    worker, layers = _worker(engine)
    blocks = list(range(4, 60))[::-1]
    first = engine.encode(_prompt(engine, documents[::-1]))
    plan = plan_request(engine.library, first, 0, BlendConfig(**TOY)).plan
    assert not worker.run(
        BlendJob("gone", plan, BlendConfig(**TOY), 0, len(first) - 1, blocks)
    ).failed
    ids = engine.encode(_prompt(engine, documents[:2], "Which river?"))
    plan = plan_request(engine.library, ids, 0, BlendConfig("full")).plan
    assert not worker.run(
        BlendJob("next", plan, BlendConfig("full"), 0, len(ids) - 1, blocks)
    ).failed
    cache = _reference_kv(engine, ids)
    for layer, paged in enumerate(layers):
        for position in range(len(ids) - 1):
            key, value = paged.read(blocks[position // BLOCK] * BLOCK + position % BLOCK)
            torch.testing.assert_close(
                key, cache.layers[layer].keys[0][:, position], atol=1e-5, rtol=1e-4
            )
            torch.testing.assert_close(
                value, cache.layers[layer].values[0][:, position], atol=1e-5, rtol=1e-4
            )


def test_a_blend_that_cannot_write_reports_its_blocks(
    engine: BlendEngine, documents: list[str]
) -> None:
    worker, _ = _worker(engine)
    ids = engine.encode(_prompt(engine, documents))
    plan = plan_request(engine.library, ids, 0, BlendConfig("full"))
    job = BlendJob("r", plan.plan, BlendConfig("full"), 0, len(ids) - 1, [1])  # too few blocks
    outcome = worker.run(job)
    assert outcome.failed and outcome.error
    assert worker.take_failed_blocks() == {1}
    assert worker.take_failed_blocks() == set()


def test_the_gate_passes_on_the_models_forward_and_fails_otherwise(engine: BlendEngine) -> None:
    worker, _ = _worker(engine)

    def forward(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return engine.model(torch.tensor([ids])).logits[0, -1].float()

    passed, message = worker.gate(forward)
    assert passed, message
    passed, message = worker.gate(lambda ids: forward(ids) * 1.5)
    assert not passed and "does not reproduce" in message

    def broken(ids: list[int]) -> torch.Tensor:
        raise RuntimeError("no backend")

    passed, message = worker.gate(broken)
    assert not passed and "no backend" in message


def test_core_kvblend_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, kvblend, kvblend.vllm.planning; assert 'vllm' not in sys.modules, 1"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pipeline_parallel_vllm_is_refused_with_what_is_unsupported() -> None:
    from kvblend.vllm.sides import WorkerHooks, _unsupported

    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2)
    hooks = WorkerHooks(ConnectorSettings(), SimpleNamespace(parallel_config=parallel), None)
    hooks.register({})
    report = hooks.report()
    assert report is not None and report.verdict is not None
    passed, message = report.verdict
    assert not passed and "pipeline_parallel_size=2" in message and "could not start" in message
    # tensor parallelism is blended, each rank with its own heads (tests/vllm/test_vllm_ranks.py)
    tensor = SimpleNamespace(tensor_parallel_size=3, pipeline_parallel_size=1)
    assert _unsupported(SimpleNamespace(parallel_config=tensor)) is None


def test_vllms_default_failure_policy_is_warned_about() -> None:
    """vLLM fails a request whose claimed tokens were not written unless told to recompute."""
    from kvblend.vllm.sides import failure_policy_warning

    said = failure_policy_warning(SimpleNamespace(kv_load_failure_policy="fail"))
    assert said is not None and "'fail'" in said and '"recompute"' in said
    assert failure_policy_warning(SimpleNamespace(kv_load_failure_policy="recompute")) is None
