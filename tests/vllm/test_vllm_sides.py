"""The connector's two sides without vLLM: planning, claims and counts; blending into a paged cache.

`kvblend.vllm.request_plan` and `kvblend.vllm.scheduling.scheduler` decide from token ids alone;
they are checked here against the engine's own forecast (`BlendEngine.explain`) over tiny models.
`kvblend.vllm.execution.blending` runs the blend loop through any model adapter; here a
transformers `Decoder` stands in for vLLM's modules and a toy paged cache for vLLM's, and the K/V
it writes is checked against transformers' own cache of the same prompt. `tests/vllm/test_vllm.py`
checks the same code inside vLLM.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.blend.selectors import base as selectors_base
from kvblend.prompt.plan import TokenKind
from kvblend.store import MemoryKVStore
from kvblend.vllm import compat, fallbacks
from kvblend.vllm.admission import BlendTimed, Calibrated, admission
from kvblend.vllm.costs import CostModel, blend_features, vllm_features
from kvblend.vllm.execution.blending import WorkerModel, gate, run_job
from kvblend.vllm.execution.calibration import CalibrationJob, synthetic_plan
from kvblend.vllm.request_plan import plan_request, restrict
from kvblend.vllm.requests import BlendJob, BlendOutcome, RequestStatus, WorkerReport
from kvblend.vllm.scheduling.scheduler import SchedulerSide
from kvblend.vllm.settings import ConnectorSettings, check_options, request_config

WORDS = "alpha beta gamma delta river stone cloud maple copper violin lisbon harbor".split()
TOY = {"short_document": 0, "min_recompute": 0, "full_above": 1.0}
BLOCK = 16  # tokens a paged-cache block holds here


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
    """The blend recomputes vLLM's prefix hit: with most of the prompt in it, vLLM is faster."""
    ids = engine.encode(_prompt(engine, documents))
    last = plan_request(engine.library, ids, 0, BlendConfig(**TOY)).plan.spans[-1]
    side = _side(engine, when="faster")
    _calibrate_per_row(side)
    assert side.matched(_request("r", ids), last.start + 3) == (0, False)
    plan = side.requests["r"].plan
    assert str(plan.fallback).startswith("vllm_faster")
    assert plan.forecast is not None and plan.forecast.vllm_s < plan.forecast.blend_s
    side.matched(_request("s", ids), 0)  # from the start, the blend computes fewer rows
    fresh = side.requests["s"].plan
    assert fresh.claimed == len(ids) - 1 and fresh.forecast is not None
    assert fresh.forecast.blend_s < fresh.forecast.vllm_s
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
    assert plan.claimed == 0 and plan.fallback == "store unreachable: OSError: store down"
    assert plan.missing == [] and plan.not_stored == []  # not stored after it: it may be


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


def test_a_registered_strategy_is_costed_by_vllm_from_its_own_forecast(
    engine: BlendEngine, documents: list[str]
) -> None:
    """The rows a blend computes come from the strategy's forecast (recomputed rows and a
    probe's share of the layers), the forecast ``explain`` reports: no second forecast."""
    import numpy as np

    from kvblend.blend import selectors
    from kvblend.blend.selectors.base import MOVED, Forecast, Selection, Selector

    class ProbingLastTokens(Selector):
        """Recompute the last 3 moved rows of each document, after a probe of half the layers."""

        name = "probing-last-tokens"

        def forecast(self, kinds: Any, spans: Any) -> Forecast:
            moved = np.asarray(kinds) == MOVED
            rows = sum(int(moved[max(s.start, s.end - 3) : s.end].sum()) for s in spans)
            probe = int((np.asarray(kinds) != MOVED).sum()) * 0.5
            return Forecast(rows, partial_rows=probe)

        def select(self, context: Any) -> Selection:  # pragma: no cover - not run here
            return Selection(context.uncached.nonzero().squeeze(1))

    selectors.register(ProbingLastTokens)
    try:
        config = BlendConfig("probing-last-tokens")
        prompt = _prompt(engine, documents[::-1])
        plan = plan_request(engine.library, engine.encode(prompt), 0, config)
        uncached = int((plan.plan.kinds == TokenKind.COMPUTE).sum())
        partial = int((plan.plan.kinds != TokenKind.MOVED).sum()) * 0.5
        assert plan.fallback is None and plan.recomputed > 0
        assert plan.recomputed == engine.explain(prompt, config).recomputed_tokens
        assert plan.rows == round(uncached + plan.recomputed + partial)
        costs = CostModel()
        costs.calibrate(
            [(vllm_features(n, 0), 1e-3 * n) for n in (128, 512, 2048)],
            [(blend_features(n, 4 * n), 1e-3 * n) for n in (128, 512, 2048)],
        )
        decided = admission("faster", costs).decide(plan, "faster").forecast
        assert decided == costs.forecast(plan.total, 0, plan.rows)
    finally:
        del selectors.SELECTORS["probing-last-tokens"]


def test_settings_and_request_choices() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"strategy": "epic", "settings": {"epic_tokens": 4}, "when": "always", "slice_s": 0.5}
    )
    assert settings.config == BlendConfig("epic", epic_tokens=4)
    assert (settings.when, settings.slice_s) == ("always", 0.5)
    with pytest.raises(ValueError, match="no setting 'stratgy'"):
        ConnectorSettings.from_extra_config({"stratgy": "full"})
    with pytest.raises(ValueError, match="'when' must be one of"):
        ConnectorSettings.from_extra_config({"when": "sometimes"})
    with pytest.raises(ValueError, match="slice_s"):
        ConnectorSettings.from_extra_config({"slice_s": 0})
    assert ConnectorSettings.from_extra_config({}).kv_codec == "none"
    assert ConnectorSettings.from_extra_config({"kv_codec": "INT8"}).kv_codec == "int8"
    with pytest.raises(ValueError, match="'kv_codec': unknown KV codec 'int3'"):
        ConnectorSettings.from_extra_config({"kv_codec": "int3"})
    default = BlendConfig()
    assert request_config(default, None).config is default
    assert request_config(default, {"kvblend": False}).config is None
    assert request_config(default, {"kvblend": {"strategy": "full"}}).config == BlendConfig("full")
    nested = {"kvblend": {"strategy": "attention", "settings": {"recompute_ratio": 0.3}}}
    assert request_config(default, nested).config == BlendConfig(recompute_ratio=0.3)
    settings_only = {"kvblend": {"settings": {"recompute_ratio": 0.3}, "when": "always"}}
    choice = request_config(default, settings_only)
    assert choice.config == BlendConfig(recompute_ratio=0.3) and choice.when == "always"


@pytest.mark.parametrize(
    "params, says",
    [
        ({"kvblend": {"recompute_ratio": 0.3}}, "has no key 'recompute_ratio'"),  # flat settings
        ({"kvblend": {"settings": {"no_such_setting": 1}}}, "no_such_setting"),
        ({"kvblend": {"strategy": "nope"}}, "nope"),
        ({"kvblend": {"settings": [1]}}, "must be a dict"),
        ({"kvblend": {"strategy": 3}}, "must be a string"),
        ({"kvblend": {"when": "later"}}, "'when' must be one of"),
        ({"kvblend": "full"}, "must be false or a dict"),
        ({"kvblend": True}, "must be false or a dict"),
    ],
)
def test_request_options_in_another_form_are_refused(params: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        request_config(BlendConfig(), params)
    with pytest.raises(ValueError, match=re.escape(says)):
        check_options(params)  # what vLLM's frontend runs on each request as it arrives
    check_options({"other_connector": {"x": 1}})  # not kvblend's: left alone
    check_options(None)


# ---------------------------------------------------------------- scheduler side


@dataclass
class _PrefillStats:
    """vLLM's ``PrefillStats`` of a request (its fields and ``set``)."""

    num_prompt_tokens: int
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_local_cached_tokens: int = 0
    num_external_cached_tokens: int = 0

    def set(self, num_prompt_tokens: int, num_local: int, num_external: int) -> None:
        self.num_prompt_tokens, self.num_local_cached_tokens = num_prompt_tokens, num_local
        self.num_external_cached_tokens = num_external
        self.num_cached_tokens = num_local + num_external
        self.num_computed_tokens = num_prompt_tokens - self.num_cached_tokens


def _request(request_id: str, ids: list[int], **fields: Any) -> SimpleNamespace:
    stats = _PrefillStats(len(ids), num_computed_tokens=len(ids))
    hashes = [bytes([index]) * 32 for index in range(len(ids) // BLOCK)]  # vLLM's own, one a block
    values = dict(
        request_id=request_id, prompt_token_ids=ids, num_preemptions=0,
        sampling_params=SimpleNamespace(prompt_logprobs=None), lora_request=None,
        mm_features=[], kv_transfer_params=None, prefill_stats=stats, block_hashes=hashes,
        _block_hasher=None,
    )  # fmt: skip
    values.update(fields)
    return SimpleNamespace(**values)


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


class _Clock:
    """A clock the test moves (seconds)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _side(
    engine: BlendEngine, *, parity: bool = False, when: str = "always", clock: Any = None
) -> SchedulerSide:
    settings = ConnectorSettings(config=BlendConfig(**TOY), parity=parity, when=when)
    clock = clock or _Clock()
    policy = admission(when, CostModel(clock))
    return SchedulerSide(settings, engine.library, policy, block_size=BLOCK, clock=clock)


def _calibrate_per_row(
    side: SchedulerSide, seconds_per_row: float = 1e-3, blend_start_s: float = 0.0
) -> None:
    """A machine where every computed row costs the same, in vLLM and in a blend.

    ``blend_start_s``: what a blend costs before its first row.
    """
    rows = (128, 512, 1024, 2048)
    side.admission.observe(Calibrated(
        [(vllm_features(n, 0).tolist(), n * seconds_per_row) for n in rows],
        [(blend_features(n, 2 * n).tolist(), blend_start_s + n * seconds_per_row) for n in rows],
    ))  # fmt: skip


def _deciding_side(engine: BlendEngine, clock: Any = None, **calibration: float) -> SchedulerSide:
    """A side choosing by forecast, its gate passed and its cost model calibrated."""
    side = _side(engine, when="faster", clock=clock)
    side.worker_output(WorkerReport(verdict=(True, "passed")))
    _calibrate_per_row(side, **calibration)
    return side


def _scheduled(*request_ids: str) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=i, num_computed_tokens=0) for i in request_ids],
        num_scheduled_tokens=dict.fromkeys(request_ids, 1), scheduled_cached_reqs=None,
    )  # fmt: skip


def _blend_through(side: SchedulerSide, request: Any, outcome: BlendOutcome) -> dict[str, Any]:
    """Run a claimed request through allocation, its blend and its end; return its record."""
    claimed, _ = side.matched(request, 0)
    side.allocated(request, _Blocks(list(range(1, 64))), claimed or 0)
    side.metadata(_scheduled())
    side.worker_output(WorkerReport(outcomes=[outcome]))
    side.allocated(request, _Blocks(list(range(1, 64))), 0)  # scheduled once its KV is there
    params = side.finished(request)
    assert params is not None
    record: dict[str, Any] = params["kvblend"]
    return record


def test_the_scheduler_waits_for_the_gate_then_loads_asynchronously(
    engine: BlendEngine, documents: list[str]
) -> None:
    side = _side(engine, parity=True)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("r1", ids)
    assert side.matched(request, 0) == (None, False)  # no verdict yet: asked again
    side.worker_output(WorkerReport(verdict=(True, "passed")))
    claimed, asynchronous = side.matched(request, 0)
    assert claimed == len(ids) - 1 and asynchronous  # the request waits for its KV
    assert side.requests["r1"].status is RequestStatus.CLAIMED
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    assert side.requests["r1"].status is RequestStatus.SENT
    reused = engine.explain(engine.tokenizer.decode(ids), BlendConfig(**TOY)).reused_tokens
    assert request.prefill_stats.num_cached_tokens == reused
    assert request.prefill_stats.num_computed_tokens == len(ids) - reused
    meta = side.metadata(_scheduled())  # not scheduled itself: it waits, its job goes out
    (job,) = meta.jobs
    assert (job.start, job.stop, job.block_ids) == (0, len(ids) - 1, list(range(1, 9)))
    assert side.requests["r1"].status is RequestStatus.BLENDING
    assert side.metadata(_scheduled()).jobs == []
    outcome = BlendOutcome("r1", reused=reused, rows=90, total=len(ids), compute_s=0.5)
    side.worker_output(WorkerReport(outcomes=[outcome]))
    assert side.requests["r1"].status is RequestStatus.DONE
    side.allocated(request, _Blocks(list(range(1, 9))), 0)  # scheduled once its KV is there
    assert side.metadata(_scheduled("r1")).jobs == []
    params = side.finished(request)
    assert params is not None and params["kvblend"]["cached_tokens"] == reused
    assert params["kvblend"]["blend_s"] == 0.5
    assert side.requests == {}


def test_the_gate_is_waited_for_from_the_first_request_however_long_the_server_idled(
    engine: BlendEngine, documents: list[str]
) -> None:
    """The workers' verdict comes with a step's output, and no step runs before a request: a
    server idle for an hour before its first prompt still waits for it, then blends."""
    from kvblend.vllm.scheduling.scheduler import GATE_WAIT_S

    clock = _Clock()
    side = _side(engine, parity=True, clock=clock)
    clock.now += 3600  # started, then idle
    request = _request("late", engine.encode(_prompt(engine, documents[::-1])))
    assert side.matched(request, 0) == (None, False)
    clock.now += GATE_WAIT_S / 2
    assert side.matched(request, 0) == (None, False)  # still waiting: the steps run now
    side.worker_output(WorkerReport(verdict=(True, "passed")))
    assert side.matched(request, 0)[0] > 0
    never = _side(engine, parity=True, clock=clock)
    assert never.matched(request, 0) == (None, False)
    clock.now += GATE_WAIT_S + 1  # no verdict in time: vLLM prefills everything
    assert never.matched(request, 0) == (0, False)
    assert never.gate is not None and not never.gate[0]


def test_the_faster_path_is_chosen_and_both_forecasts_reported(
    engine: BlendEngine, documents: list[str]
) -> None:
    ids = engine.encode(_prompt(engine, documents[::-1]))
    side = _side(engine, when="faster")
    request = _request("f1", ids)
    side.worker_output(WorkerReport(verdict=(True, "passed")))
    assert side.matched(request, 0) == (None, False)  # no calibration yet: asked again
    _calibrate_per_row(side)  # rows cost the same: the blend computes fewer, it wins
    claimed, _ = side.matched(request, 0)
    assert claimed == len(ids) - 1
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    record = side.requests["f1"].record
    assert record is not None and record["forecast_blend_s"] < record["forecast_vllm_s"]
    # blends observed 10x slower per row than calibrated: vLLM prefills the next one
    for _ in range(40):
        side.admission.observe(BlendTimed(500, 1000, 5.0))
    other = _request("f2", ids)
    assert side.matched(other, 0) == (0, False)
    side.allocated(other, _Blocks([1]), 0)
    params = side.finished(other)
    assert params is not None
    record = params["kvblend"]
    assert record["strategy"] == "vllm" and record["fallback"].startswith("vllm_faster")
    assert record["forecast_blend_s"] > record["forecast_vllm_s"] > 0
    counts = side.take_counts()
    assert counts["vllm"] == 1 and counts["vllm_reasons"] == {"vllm_faster": 1}
    assert counts["forecast_blend_ms"] > counts["forecast_vllm_ms"]


@pytest.fixture(scope="module")
def long_documents(engine: BlendEngine) -> list[str]:
    rng = random.Random(9)
    texts = [_document(rng, 80) for _ in range(8)]  # about 500 tokens each (bytes)
    engine.precompute(texts)
    return texts


def test_a_fresh_servers_first_rag_prompt_is_blended_and_so_is_each_one_minutes_apart(
    engine: BlendEngine, long_documents: list[str]
) -> None:
    """Learning vLLM's speed never costs a waiting user: a prompt the blend is forecast to win
    is blended on a server that never timed vLLM on one, and with 6 minutes between prompts
    (vLLM's correction long faded back to its calibration), each is blended too."""
    clock = _Clock()
    side = _side(engine, when="faster", clock=clock)
    side.worker_output(WorkerReport(verdict=(True, "passed")))
    # this machine: 4 ms a row computed, a blend 1.5 ms more a prompt token (read, moved,
    # written): a 4K blend is forecast at 0.5-0.8 of vLLM's prefill, a win but no clear one
    side.admission.observe(Calibrated(
        [(vllm_features(n, 0).tolist(), 4e-3 * n) for n in (256, 1024, 2048, 4096)],
        [(blend_features(r, n).tolist(), 4e-3 * r + 1.5e-3 * n)
         for r, n in ((384, 384), (300, 1024), (600, 2048), (1100, 4096))],
    ))  # fmt: skip
    for number in range(5):
        order = long_documents[number:] + long_documents[:number]  # never as stored
        ids = engine.encode(_prompt(engine, order[::-1]))
        assert 3800 < len(ids) < 4400
        request = _request(f"q{number}", ids)
        forecast = side.admission.decide(plan_request(
            engine.library, ids, 0, BlendConfig(**TOY)), "faster").forecast  # fmt: skip
        assert forecast is not None and 0.5 < forecast.blend_s / forecast.vllm_s < 0.8
        outcome = BlendOutcome(request.request_id, rows=1200, total=len(ids),
                               compute_s=forecast.blend_s)  # fmt: skip
        record = _blend_through(side, request, outcome)
        assert record["fallback"] is None and record["strategy"] == "attention", record
        clock.now += 360  # 6 minutes to the next question
    counts = side.take_counts()
    assert counts["blended"] == 5 and counts["vllm"] == 0


def test_a_prompt_no_blend_can_win_is_not_planned(
    engine: BlendEngine, documents: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mostly in vLLM's prefix cache: even a blend computing no row loses, so nothing is planned."""
    from kvblend.vllm.scheduling import scheduler

    ids = engine.encode(_prompt(engine, documents[::-1]))
    side = _deciding_side(engine, blend_start_s=0.05)
    planned: list[int] = []
    real = scheduler.plan_request
    monkeypatch.setattr(
        scheduler, "plan_request", lambda *args: planned.append(args[2]) or real(*args)
    )
    hit = _request("hit", ids)
    assert side.matched(hit, len(ids) - 40) == (0, False)
    assert planned == []
    side.allocated(hit, _Blocks([1]), 0)
    params = side.finished(hit)
    assert params is not None
    record = params["kvblend"]
    assert record["fallback"].startswith("vllm_faster") and "not planned" in record["fallback"]
    assert record["forecast_blend_s"] >= 0.05 > record["forecast_vllm_s"]
    fresh = _request("fresh", ids)
    side.matched(fresh, 0)
    assert planned == [0]  # a prompt the blend may win is planned


def test_a_blend_is_observed_by_its_own_slices_not_its_wait(
    engine: BlendEngine, documents: list[str]
) -> None:
    """A blend that waited behind others must not make the next blend's forecast longer."""
    side = _side(engine, when="faster")
    _calibrate_per_row(side)
    costs = side.admission.costs  # type: ignore[attr-defined]
    rows, total = 500, 1000
    own = costs.blend.base(blend_features(rows, total))
    for number in range(5):
        outcome = BlendOutcome(f"b{number}", rows=rows, total=total, compute_s=own)
        outcome.blend_s = 10 * own  # from its arrival: most of it waiting behind other blends
        side.worker_output(WorkerReport(outcomes=[outcome]))
    assert costs.blend.residual == pytest.approx(1.0, rel=1e-3)


def test_blocks_of_approximate_kv_get_salted_hashes_exact_ones_keep_vllms(
    engine: BlendEngine, documents: list[str]
) -> None:
    """From the first moved document's block on, no other request finds the blend's blocks."""
    ids = engine.encode(_prompt(engine, documents[::-1]))
    side = _side(engine)
    request = _request("h1", ids)
    own = list(request.block_hashes)
    claimed, _ = side.matched(request, 0)
    plan = side.requests["h1"].plan
    first = plan.approximate_from // BLOCK
    moved = [i for i, kind in enumerate(plan.plan.kinds) if kind == TokenKind.MOVED]
    assert claimed > 0 and plan.approximate_from == moved[0] > 0
    assert request.block_hashes[:first] == own[:first]  # the head: vLLM's own hashes, shared
    assert all(a != b for a, b in zip(request.block_hashes[first:], own[first:], strict=True))
    again = _request("h2", ids)  # the same prompt blended again: salted apart from the first
    side.matched(again, 0)
    assert set(again.block_hashes[first:]).isdisjoint(request.block_hashes[first:])
    # a request vLLM prefills after all (planned again: vLLM's prefix hit grew) gets its own
    # hashes back
    again.kv_transfer_params = {"kvblend": False}
    assert side.matched(again, BLOCK) == (0, False)
    assert again.block_hashes == own
    # strategy full computes every row exactly: nothing salted
    exact = _request("h3", ids, kv_transfer_params={"kvblend": {"strategy": "full"}})
    assert side.matched(exact, 0)[0] > 0 and exact.block_hashes == own


def test_blocks_filled_after_the_prompt_are_salted_from_the_first_approximate_one(
    engine: BlendEngine, documents: list[str]
) -> None:
    """The first moved row in the prompt's last, partial block: that block, once generated
    tokens fill it, and every one after get salted hashes too (vLLM's hasher is wrapped)."""
    import hashlib

    ids = engine.encode(_prompt(engine, documents[::-1]))

    def hasher(request: Any) -> list[bytes]:  # vLLM's: each new full block, chained
        out, parent = [], (request.block_hashes or [b""])[-1]
        for index in range(len(request.block_hashes), len(request.tokens) // BLOCK):
            block = bytes(str(request.tokens[index * BLOCK : (index + 1) * BLOCK]), "ascii")
            parent = hashlib.sha256(parent + block).digest()
            out.append(parent)
        return out

    def grow(request: Any, tokens: list[int]) -> None:
        request.tokens += tokens
        request.block_hashes.extend(request._block_hasher(request))

    plain = _request("g0", ids, block_hashes=[], tokens=[], _block_hasher=hasher)
    grow(plain, ids + [7] * 3 * BLOCK)  # vLLM's own hashes of the prompt and 3 blocks more
    request = _request("g1", ids, block_hashes=[], tokens=[], _block_hasher=hasher)
    grow(request, ids)
    first = len(ids) // BLOCK  # the first approximate row is in the last, partial block
    own = compat.salt_hashes(request, first)
    assert request.block_hashes == plain.block_hashes[:first]  # the prompt's full blocks: exact
    grow(request, [7] * 3 * BLOCK)  # the answer fills that block, then two more
    assert request.block_hashes[:first] == plain.block_hashes[:first]
    assert len(request.block_hashes) == len(plain.block_hashes)
    salted = request.block_hashes[first:]
    assert set(salted).isdisjoint(plain.block_hashes)
    compat.unsalt_hashes(request, own)  # vLLM prefills it after all: its own hasher back
    assert request._block_hasher is hasher


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"num_preemptions": 1}, "preemption"),
        ({"kv_transfer_params": {"kvblend": False}}, "off"),
        ({"sampling_params": SimpleNamespace(prompt_logprobs=5)}, "logprobs"),
        ({"kv_transfer_params": {"kvblend": {"strategy": "nope"}}}, "request option refused"),
    ],
)
def test_requests_vllm_must_prefill_itself_are_not_claimed(
    engine: BlendEngine, documents: list[str], fields: dict[str, Any], reason: str
) -> None:
    side = _side(engine)
    request = _request("r", engine.encode(_prompt(engine, documents)), **fields)
    assert side.matched(request, 0) == (0, False)
    side.allocated(request, _Blocks([1]), 0)
    params = side.finished(request)
    assert params is not None and reason in params["kvblend"]["fallback"]
    assert params["kvblend"].get("refused", False) == ("refused" in reason)
    assert side.take_counts()["vllm_reasons"].get("refused", 0) == int("refused" in reason)


def test_a_request_resumed_after_preemption_is_not_claimed_again(
    engine: BlendEngine, documents: list[str]
) -> None:
    side = _side(engine)
    request = _request("r4", engine.encode(_prompt(engine, documents[::-1])))
    claimed, _ = side.matched(request, 0)
    assert claimed > 0
    request.num_preemptions = 1  # preempted: its blocks were freed, vLLM starts it over
    assert side.matched(request, 0) == (0, False)


def test_a_blend_that_reused_less_reports_its_true_count(
    engine: BlendEngine, documents: list[str]
) -> None:
    side = _side(engine)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("r2", ids)
    claimed, _ = side.matched(request, 0)
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    assert request.prefill_stats.num_cached_tokens > 0
    side.metadata(_scheduled())
    lost = BlendOutcome("r2", reused=0, lost=["entry 0123 unusable (checksum mismatch)"])
    side.worker_output(WorkerReport(outcomes=[lost]))
    assert request.prefill_stats.num_cached_tokens == 0
    assert request.prefill_stats.num_computed_tokens == len(ids)
    params = side.finished(request)
    assert params is not None and params["kvblend"]["cached_tokens"] == 0
    assert params["kvblend"]["lost"] == lost.lost


def test_a_request_cancelled_mid_blend_stops_it_and_leaves_no_state(
    engine: BlendEngine, documents: list[str]
) -> None:
    """vLLM keeps a waiting request's blocks until the worker says its blend has stopped."""
    side = _side(engine)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("c1", ids)
    claimed, _ = side.matched(request, 0)
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    (job,) = side.metadata(_scheduled()).jobs  # the worker starts blending it
    params = side.finished(request)  # aborted while it blends
    assert params is not None and params["kvblend"]["cached_tokens"] > 0
    assert set(side.requests) == {"c1"}  # only until the outcome arrives
    assert side.metadata(_scheduled()).stop == ["c1"]  # the worker is told to stop it
    side.worker_output(WorkerReport(outcomes=[BlendOutcome("c1", cancelled=True)]))
    assert side.requests == {} and params["kvblend"]["cancelled"]
    counts = side.take_counts()
    assert counts["requests"] == counts["blended"] == 1
    assert side.metadata(_scheduled()).jobs == []  # nothing is ever blended for it again


@pytest.mark.parametrize("when", ["waiting for the gate", "planned", "allocated"])
def test_a_request_cancelled_before_its_blend_leaves_no_state(
    engine: BlendEngine, documents: list[str], when: str
) -> None:
    side = _side(engine, parity=True)
    request = _request("c2", engine.encode(_prompt(engine, documents[::-1])))
    if when != "waiting for the gate":
        side.worker_output(WorkerReport(verdict=(True, "passed")))
    claimed, _ = side.matched(request, 0)
    if when == "allocated":
        side.allocated(request, _Blocks(list(range(1, 9))), claimed or 0)
    side.finished(request)
    assert side.requests == {}
    meta = side.metadata(_scheduled())
    assert meta.jobs == [] and meta.stop == []


def test_a_preempted_request_keeps_its_first_record_and_is_not_claimed_again(
    engine: BlendEngine, documents: list[str]
) -> None:
    side = _side(engine)
    ids = engine.encode(_prompt(engine, documents[::-1]))
    request = _request("p1", ids)
    claimed, _ = side.matched(request, 0)
    side.allocated(request, _Blocks(list(range(1, 9))), claimed)
    side.metadata(_scheduled())
    side.worker_output(WorkerReport(outcomes=[BlendOutcome("p1", reused=7, blend_s=0.5)]))
    side.allocated(request, _Blocks(list(range(1, 9))), 0)  # its KV arrived: scheduled
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
    assert side.requests == {}
    counts = side.take_counts()
    assert counts["blended"] == 1 and counts["vllm"] == 0


def test_a_failed_gate_claims_nothing(engine: BlendEngine, documents: list[str]) -> None:
    side = _side(engine, parity=True)
    side.worker_output(WorkerReport(verdict=(False, "does not reproduce vLLM")))
    request = _request("r", engine.encode(_prompt(engine, documents)))
    assert side.matched(request, 0) == (0, False)


def test_each_reason_for_finding_nothing_is_its_own(documents: list[str]) -> None:
    """An empty store, another model's entries, documents not stored: three reasons."""
    from kvblend.vllm.documents import StoreSummary

    def reason(engine: BlendEngine, text: str, summary: StoreSummary) -> str:
        side = SchedulerSide(
            ConnectorSettings(config=BlendConfig(**TOY), parity=False, when="always"),
            engine.library, admission("always"), block_size=BLOCK, store_summary=summary,
        )  # fmt: skip
        request = _request("x", engine.encode(_prompt(engine, [text])))
        assert side.matched(request, 0) == (0, False)
        side.allocated(request, _Blocks([1]), 0)
        params = side.finished(request)
        assert params is not None
        return str(params["kvblend"]["fallback"])

    store = MemoryKVStore()
    ours = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=store)
    summary = StoreSummary(store, ours.library.fingerprint, "tiny", "memory")
    assert reason(ours, documents[0], summary).startswith("empty store")
    other = BlendEngine(tiny_model("qwen2"), byte_tokenizer(), store=store)
    other.precompute(documents[:2])  # another model's entries, same store
    said = reason(ours, documents[0], StoreSummary(store, ours.library.fingerprint, "t", "m"))
    assert said.startswith("other model") and "2 entries" in said
    ours.register(documents[2:3])  # known to this model, never computed
    said = reason(ours, documents[2], StoreSummary(store, ours.library.fingerprint, "t", "m"))
    assert said.startswith("not stored") and "(1)" in said
    ours.precompute(documents[3:4])
    fresh = StoreSummary(store, ours.library.fingerprint, "t", "m")
    said = reason(ours, "No document here.", fresh)
    assert said.startswith("no stored document") and "1 entries of this model" in said
    line = StoreSummary(store, ours.library.fingerprint, "tiny", "memory").describe()
    assert "memory: 1 entries of model tiny" in line and "other models' entries: 2 of" in line


class _Unreachable(MemoryKVStore):
    """A store that cannot say what it holds (an outage)."""

    def contains(self, key: str) -> bool:
        raise OSError("store down")


def _fallback_cases(
    engine: BlendEngine, documents: list[str]
) -> dict[str, tuple[SchedulerSide, list[int], int, dict[str, Any]]]:
    """Every reason vLLM prefills a request itself, by its code: a fresh side for it, the prompt's
    token ids, vLLM's prefix hit and the request's fields."""
    from kvblend.vllm.documents import StoreSummary

    ids = engine.encode(_prompt(engine, documents[::-1]))
    bare = engine.encode("No document here, only a question?")
    unknown = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    unknown.register(documents[:1])  # known, its KV never computed
    down = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    down.register(documents[:1])
    down.library.store = _Unreachable()
    empty = StoreSummary(MemoryKVStore(), unknown.library.fingerprint, "tiny", "memory")

    def over(library: Any, summary: Any = None) -> SchedulerSide:
        settings = ConnectorSettings(config=BlendConfig(**TOY), parity=False, when="always")
        return SchedulerSide(settings, library, admission("always"), block_size=BLOCK,
                             store_summary=summary)  # fmt: skip

    def asks(**options: Any) -> dict[str, Any]:
        return {"kv_transfer_params": {"kvblend": options}}

    failed = _side(engine, parity=True)
    failed.worker_output(WorkerReport(verdict=(False, "logits differ")))
    return {
        "kvblend_off": (_side(engine), ids, 0, {"kv_transfer_params": {"kvblend": False}}),
        "refused": (_side(engine), ids, 0, asks(strategy="nope")),
        "prompt_logprobs": (_side(engine), ids, 0,
                            {"sampling_params": SimpleNamespace(prompt_logprobs=5)}),
        "not_generation": (_side(engine), ids, 0, {"sampling_params": None}),
        "lora": (_side(engine), ids, 0, {"lora_request": object()}),
        "multimodal": (_side(engine), ids, 0, {"mm_features": [object()]}),
        "preempted": (_side(engine), ids, 0, {"num_preemptions": 1}),
        "parity_gate_failed": (failed, ids, 0, {}),
        "prefix_cached": (_side(engine), ids, len(ids) - 1, {}),
        "no_stored_document": (_side(engine), bare, 0, {}),
        "empty_store": (over(unknown.library, empty), bare, 0, {}),
        "not_stored": (over(unknown.library), unknown.encode(_prompt(unknown, documents[:1])), 0,
                       {}),
        "store_unreachable": (over(down.library), down.encode(_prompt(down, documents[:1])), 0,
                              {}),
        "planning_failed": (over(SimpleNamespace()), ids, 0, {}),  # a library it cannot use
        "min_recompute": (_side(engine), ids, 0, asks(settings={"min_recompute": 10_000})),
        "short_document": (_side(engine), ids, 0, asks(settings={"short_document": 10_000})),
        "full_above": (_side(engine), ids, 0, asks(settings={"full_above": 0.01})),
        "vllm_faster": (_deciding_side(engine, blend_start_s=0.05), ids, len(ids) - 40, {}),
        "unclaimed": (_side(engine), ids, 0, {}),  # claimed, and vLLM allocates none of it
    }  # fmt: skip


def _left_to_vllm(
    engine: BlendEngine, documents: list[str], caplog: pytest.LogCaptureFixture
) -> dict[str, tuple[list[dict[str, Any]], dict[str, int], list[str]]]:
    """Run two requests of each reason through its side: their records, the side's counts by
    reason (vLLM's metrics' ``reason`` labels) and the warnings logged, by the reason's code."""
    seen = {}
    for code, (side, ids, start, fields) in _fallback_cases(engine, documents).items():
        caplog.clear()
        records = []
        for number in range(2):
            request = _request(f"{code}-{number}", ids, **fields)
            side.matched(request, start)
            side.allocated(request, _Blocks([1]), 0)
            params = side.finished(request)
            assert params is not None, code
            records.append(params["kvblend"])
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        seen[code] = (records, side.take_counts()["vllm_reasons"], warned)
    return seen


def _unworded(record: dict[str, Any]) -> dict[str, Any]:
    """A record without its words and its planning time."""
    return {key: value for key, value in record.items() if key not in ("fallback", "plan_s")}


def test_reworded_fallbacks_keep_their_codes_metric_labels_and_log_keys(
    engine: BlendEngine,
    documents: list[str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The code a request's record, vLLM's metrics (label ``reason``) and the log's once a
    minute go by is decided with each fallback, never read back from its words: every reason
    reworded (both renderers patched, new words each time), the same codes, counts, records and
    one warning per code."""
    caplog.set_level(logging.INFO, logger="kvblend.vllm")
    plain = _left_to_vllm(engine, documents, caplog)
    said = itertools.count()
    monkeypatch.setattr(fallbacks, "describe_request_fallback",
                        lambda fallback: f"[{next(said)}] {fallback.words[::-1]}")  # fmt: skip
    monkeypatch.setattr(selectors_base, "describe_fallback",
                        lambda fallback: f"<{next(said)}> {fallback.detail.upper()}")  # fmt: skip
    reworded = _left_to_vllm(engine, documents, caplog)
    assert list(reworded) == list(plain)
    for code, (records, counts, warned) in plain.items():
        again, again_counts, again_warned = reworded[code]
        for record in records + again:
            assert record["reason"] == code and record["strategy"] == "vllm", (code, record)
        assert counts == again_counts == {code: 2}, code
        # once a minute per code: a request option refused is said as each one is refused
        expected = {"vllm_faster": 0, "refused": 2}.get(code, 1)
        assert len(warned) == len(again_warned) == expected, (code, warned, again_warned)
        assert not any(record["fallback"].startswith("[") for record in records), code
        assert [record["fallback"][0] for record in again] == ["[", "["], code
        assert again[0]["fallback"] != again[1]["fallback"], code  # worded anew each time
        assert list(map(_unworded, records)) == list(map(_unworded, again)), code
    assert "<" in reworded["full_above"][0][0]["fallback"]  # the strategy's words reworded too


# ---------------------------------------------------------------- worker side


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


def _worker(engine: BlendEngine, blocks: int = 64) -> tuple[WorkerModel, list[_PagedLayer]]:
    shape = engine.decoder.shape
    layers = [
        _PagedLayer(shape.num_kv_heads, shape.head_dim, blocks) for _ in range(shape.num_layers)
    ]
    decoder: Any = engine.decoder  # as `VLLMAdapter` without tensor parallelism
    decoder.attention_layers, decoder.tp_size = layers, 1
    decoder.kv_heads = slice(0, shape.num_kv_heads)
    decoder.gather_ranks = lambda values: values.float().reshape(1, -1)
    return WorkerModel(engine.decoder, engine.library, BLOCK), layers  # type: ignore[arg-type]


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
    outcome = run_job(worker, job)
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
    outcome = run_job(worker, BlendJob("r", plan.plan, BlendConfig(**TOY), 0, len(ids) - 1, blocks))
    assert len(outcome.lost) == 2 and outcome.reused == 0 and outcome.error is None
    cache = _reference_kv(engine, ids)  # every row computed: the model's own KV
    position = len(ids) - 2
    key, _ = layers[-1].read(blocks[position // BLOCK] * BLOCK + position % BLOCK)
    torch.testing.assert_close(key, cache.layers[-1].keys[0][:, position], atol=1e-5, rtol=1e-4)


def test_an_int8_connector_reads_its_codecs_entries_and_writes_what_the_engine_blends(
    documents: list[str],
) -> None:
    """``kv_codec``: the store's full-precision entries are misses, its int8 entries decoded."""
    model, tokenizer, store = tiny_model("llama"), byte_tokenizer(), MemoryKVStore()
    BlendEngine(model, tokenizer, store=store).precompute(documents[:3])  # full precision
    engine = BlendEngine(model, tokenizer, store=store, kv_codec="int8")
    engine.precompute(documents[:2])  # the third document: only in full precision
    worker, layers = _worker(engine)
    config = BlendConfig(**TOY)
    prompt = _prompt(engine, [documents[2], documents[1], documents[0]])
    ids = engine.encode(prompt)
    plan = plan_request(engine.library, ids, 0, config)
    assert plan.fallback is None and [text for text, _ in plan.missing] == [documents[2]]
    prompt = _prompt(engine, documents[:2][::-1])
    ids = engine.encode(prompt)
    plan = plan_request(engine.library, ids, 0, config)
    assert plan.fallback is None and plan.reused > 0 and plan.missing == []
    blocks = list(range(1, len(ids) // BLOCK + 2))
    outcome = run_job(worker, BlendJob("r", plan.plan, config, 0, len(ids) - 1, blocks))
    assert outcome.error is None and outcome.lost == [] and outcome.reused == plan.reused
    blended = engine.prefill(prompt, config)  # the engine's blend over the same int8 entries
    assert blended.stats.reused_tokens == plan.reused
    for layer, paged in enumerate(layers):
        for position in range(len(ids) - 1):
            key, value = paged.read(blocks[position // BLOCK] * BLOCK + position % BLOCK)
            torch.testing.assert_close(key, blended.keys[layer][:, position])
            torch.testing.assert_close(value, blended.values[layer][:, position])


def test_blocks_of_a_cancelled_request_get_the_next_requests_own_kv(
    engine: BlendEngine, documents: list[str]
) -> None:
    """vLLM hands a freed request's blocks to another: every row written is the new one's."""
    worker, layers = _worker(engine)
    blocks = list(range(4, 60))[::-1]
    first = engine.encode(_prompt(engine, documents[::-1]))
    plan = plan_request(engine.library, first, 0, BlendConfig(**TOY)).plan
    assert not run_job(
        worker, BlendJob("gone", plan, BlendConfig(**TOY), 0, len(first) - 1, blocks)
    ).failed
    ids = engine.encode(_prompt(engine, documents[:2], "Which river?"))
    plan = plan_request(engine.library, ids, 0, BlendConfig("full")).plan
    assert not run_job(
        worker, BlendJob("next", plan, BlendConfig("full"), 0, len(ids) - 1, blocks)
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
    outcome = run_job(worker, job)
    assert outcome.failed and outcome.error  # reported as its request's failed load


def test_the_gate_passes_on_the_models_forward_and_fails_otherwise(engine: BlendEngine) -> None:
    worker, _ = _worker(engine)

    def forward(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return engine.model(torch.tensor([ids])).logits[0, -1].float()

    passed, message = gate(worker, forward)
    assert passed, message
    passed, message = gate(worker, lambda ids: forward(ids) * 1.5)
    assert not passed and "does not reproduce" in message

    def broken(ids: list[int]) -> torch.Tensor:
        raise RuntimeError("no backend")

    passed, message = gate(worker, broken)
    assert not passed and "no backend" in message


def test_core_kvblend_does_not_import_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, kvblend, kvblend.vllm.request_plan; assert 'vllm' not in sys.modules, 1"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pipeline_parallel_vllm_is_refused_with_what_is_unsupported() -> None:
    from kvblend.vllm.execution.worker import Worker
    from kvblend.vllm.sides import unsupported, worker_model

    parallel = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=2)
    config = SimpleNamespace(parallel_config=parallel)
    worker = Worker(ConnectorSettings(), config, None)
    worker.register(functools.partial(worker_model, ConnectorSettings(), config))
    report = worker.report()
    assert report is not None and report.verdict is not None
    passed, message = report.verdict
    assert not passed and "pipeline_parallel_size=2" in message and "could not start" in message
    # tensor parallelism is blended, each rank with its own heads (tests/vllm/test_vllm_ranks.py)
    tensor = SimpleNamespace(tensor_parallel_size=3, pipeline_parallel_size=1)
    assert unsupported(SimpleNamespace(parallel_config=tensor)) is None


def test_vllms_default_failure_policy_is_warned_about() -> None:
    """vLLM fails a request whose claimed tokens were not written unless told to recompute."""
    from kvblend.vllm.sides import failure_policy_warning

    said = failure_policy_warning(SimpleNamespace(kv_load_failure_policy="fail"))
    assert said is not None and "'fail'" in said and '"recompute"' in said
    assert failure_policy_warning(SimpleNamespace(kv_load_failure_policy="recompute")) is None


@pytest.mark.parametrize("long_run_s", [0.0, float("inf")])
def test_a_point_slower_than_long_run_s_is_run_once(engine: BlendEngine, long_run_s: float) -> None:
    """Every point runs `runs` times unless its first run took longer than ``long_run_s``."""
    forwards: list[int] = []
    job = CalibrationJob(
        tokens=(16, 32), blends=((96, "full"), (128, None), (96, "reuse")), runs=3,
        long_run_s=long_run_s,
    )  # fmt: skip
    points = job.run(_worker(engine, blocks=160)[0], lambda ids: forwards.append(len(ids)),
                     BlendConfig())  # fmt: skip
    runs = 1 if long_run_s == 0.0 else 3
    assert forwards == [16] * runs + [32] * runs  # vLLM's forward: the first two points
    assert len(points.vllm) == 2 and len(points.blend) == 3
    assert all(seconds > 0 for _, seconds in points.blend)


def test_the_calibration_blends_as_served_prompts_do_and_fixes_every_blend_weight(
    engine: BlendEngine,
) -> None:
    """The start-up calibration's blends reuse the share of rows served RAG prompts reuse (a
    blend computing every row would teach the cost model full prefill's cost per row), and a
    machine's true costs are forecast at 4K and 7.5K from its points, noisy ones too."""
    job = CalibrationJob(runs=1)
    points = job.run(_worker(engine, blocks=160)[0], lambda ids: None, BlendConfig()).blend
    assert len(points) == 4 and all(seconds > 0 for _, seconds in points)
    for (total, strategy), (features, _) in zip(job.blends, points, strict=True):
        rows, total_ = features[1], features[3]
        assert total_ == total
        plan = synthetic_plan(list(range(total)))
        uncached = int(np.count_nonzero(plan.kinds == int(TokenKind.COMPUTE)))
        if strategy == "full":
            assert rows == total
        elif strategy == "reuse":
            assert rows == uncached < 70
        else:  # the server's strategy: no fallback to full, rows reused as on served prompts
            assert 0.25 < rows / total < 0.5, (total, rows)
    # a machine: vLLM's forward, and the blend at 1.5 times its cost a row and a token pair,
    # with a fixed cost and one per prompt token (read, moved, written)
    own = np.array([0.01, 1e-3, 0.5])
    truth = np.array([0.05, 1.5e-3, 0.75, 3e-4])
    costs = CostModel()
    costs.calibrate(
        [(vllm_features(n, 0), float(own @ vllm_features(n, 0))) for n in job.tokens],
        [(np.asarray(x), float(truth @ np.asarray(x))) for x, _ in points],
    )  # fmt: skip
    for rows, total in ((997, 4153), (2712, 7751)):  # served 4K and 7.5K prompts' blends
        features = blend_features(rows, total)
        assert costs.predict(costs.blend, features) == pytest.approx(truth @ features, rel=0.02)
    # the same points timed on a loaded machine, each off by up to 15%: the forecasts keep
    # their shape (four free weights fitted to such points need not: 7.5K 1.5 times too slow)
    noisy = CostModel()
    noise = (1.15, 1.15, 0.9, 1.0)
    noisy.calibrate(
        [(vllm_features(n, 0), float(own @ vllm_features(n, 0))) for n in job.tokens],
        [(np.asarray(x), float(truth @ np.asarray(x)) * k)
         for (x, _), k in zip(points, noise, strict=True)],
    )  # fmt: skip
    for rows, total in ((997, 4153), (2712, 7751)):
        features = blend_features(rows, total)
        assert noisy.predict(noisy.blend, features) == pytest.approx(truth @ features, rel=0.2)
