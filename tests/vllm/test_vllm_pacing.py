"""The connector's blends in slices between engine steps, and its cost model, without vLLM.

`kvblend.vllm.execution.pacing.SliceRunner` runs blends as coroutines of the engine thread, a
slice of time per step; `kvblend.vllm.costs` forecasts a blend's and vLLM's prefill time. Here the
runner slices toy tasks and a real blend (a transformers model standing in for vLLM's modules, as in
`tests/vllm/test_vllm_sides.py`), whose KV must be what the same blend writes in one go.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import pytest
import torch

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.errors import BlendCancelledError
from kvblend.store import MemoryKVStore
from kvblend.vllm.costs import CostModel, blend_features, step_features, vllm_features
from kvblend.vllm.execution.blending import WorkerModel
from kvblend.vllm.execution.pacing import SliceRunner, Task, ThreadChoice
from kvblend.vllm.execution.worker import Worker
from kvblend.vllm.request_plan import plan_request
from kvblend.vllm.requests import BlendJob, StepMetadata
from kvblend.vllm.settings import ConnectorSettings

TOY = {"short_document": 0, "min_recompute": 0, "full_above": 1.0}
BLOCK = 16


def _steps(count: int, seconds: float) -> Any:
    def work(pause: Any, cancel: Any) -> int:
        for _ in range(count):
            time.sleep(seconds)
            pause()
            if cancel.is_set():
                raise BlendCancelledError("cancelled")
        return count

    return work


def test_a_task_runs_a_slice_per_call_and_resumes_where_it_paused() -> None:
    runner = SliceRunner()
    runner.submit(Task("a", _steps(20, 0.005)))
    runner.submit(Task("b", _steps(2, 0.001)))
    slices = 0
    while runner.busy:
        ran = runner.run(0.02)
        slices += 1
        assert ran < 0.02 + 0.05  # a slice ends at the first checkpoint past its budget
    done = runner.take_done()
    assert [task.key for task in done] == ["a", "b"]  # in the order they came
    assert [task.result for task in done] == [20, 2] and slices >= 4
    assert 0.1 <= done[0].compute_s < 0.1 + 0.2  # its slices only, not the pauses
    assert runner.take_done() == []


def test_a_cancelled_task_stops_at_its_next_checkpoint() -> None:
    runner = SliceRunner()
    runner.submit(Task("a", _steps(100, 0.002)))
    runner.submit(Task("b", _steps(100, 0.002)))
    runner.run(0.01)
    runner.cancel("a")  # under way
    runner.cancel("b")  # never started
    runner.run(1.0)
    a, b = runner.take_done()
    assert a.cancelled and a.result is None and b.cancelled and b.compute_s == 0
    assert not runner.busy


def test_a_failing_task_is_reported_with_its_error_and_whole_mode_runs_everything() -> None:
    def fails(pause: Any, cancel: Any) -> None:
        pause()
        raise RuntimeError("out of memory")

    runner = SliceRunner(whole=True)
    runner.submit(Task("a", _steps(10, 0.005)))
    runner.submit(Task("b", fails))
    runner.run(0.001)  # every task runs to its end, whatever the budget
    a, b = runner.take_done()
    assert a.result == 10 and isinstance(b.error, RuntimeError) and not runner.busy


def test_a_paused_task_leaves_the_engine_threads_torch_state_alone() -> None:
    """Slices run inside vLLM's inference mode; the blend's own mode holds across pauses."""
    runner = SliceRunner()

    def work(pause: Any, cancel: Any) -> bool:
        with torch.inference_mode():
            pause()
            time.sleep(0.01)
            pause()
            return torch.is_inference_mode_enabled()

    runner.submit(Task("a", work))
    with torch.inference_mode():
        runner.run(0.0)
    assert runner.busy and not torch.is_inference_mode_enabled()
    with torch.inference_mode():
        runner.run(1.0)
    (task,) = runner.take_done()
    assert task.result is True and not torch.is_inference_mode_enabled()


def _calibrated(truth_vllm: np.ndarray, truth_blend: np.ndarray) -> tuple[CostModel, list, list]:
    model = CostModel()
    vllm_points = [(vllm_features(n, p), float(truth_vllm @ vllm_features(n, p))) for n, p in
                   [(128, 0), (512, 0), (1024, 512), (2048, 0), (64, 4000)]]  # fmt: skip
    blend_points = [(blend_features(r, n), float(truth_blend @ blend_features(r, n))) for r, n in
                    [(384, 384), (300, 1024), (600, 2048), (1100, 4096)]]  # fmt: skip
    model.calibrate(vllm_points, blend_points)
    return model, vllm_points, blend_points


def test_each_job_runs_on_the_thread_count_that_runs_the_loops_ops_faster_now() -> None:
    seconds = {2: 0.02, 1: 0.05}  # idle cores: two threads are faster
    measured: list[int] = []

    def measure(count: int) -> float:
        measured.append(count)
        return seconds[count]

    choice = ThreadChoice((2, 1), measure)
    assert choice.choose("a") == (2, None) and measured == []  # a job's first slice: not held up
    assert choice.choose("a") == (2, None) and measured == [2, 1]
    seconds.update({2: 0.09, 1: 0.04})  # another job takes a core
    choice.choose("b")
    assert choice.choose("b") == (2, None) and measured == [2, 1]  # not measured again so soon
    choice._probed -= ThreadChoice.REPROBE_S
    count, said = choice.choose("b")  # a while later: measured again
    assert count == 1 and said is not None and "1 CPU thread(s)" in said and "0.44" in said
    choice._probed -= ThreadChoice.REPROBE_S
    seconds.update({2: 0.02, 1: 0.05})
    assert choice.choose("b")[0] == 2
    assert ThreadChoice((1,), measure).choose("c") == (1, None)


def test_the_loops_ops_run_on_the_count_asked_and_restore_torchs() -> None:
    from kvblend.vllm.execution.pacing import layer_ops

    own = torch.get_num_threads()
    assert 0 < layer_ops(1, heads=9, kv_heads=3, head_dim=64) < 5
    assert torch.get_num_threads() == own


def test_the_fit_finds_the_calibrations_costs_and_each_path_follows_its_own_runs() -> None:
    model, vllm_points, blend_points = _calibrated(
        np.array([0.01, 2e-3, 0.5]), np.array([0.05, 3e-3, 0.75, 1e-4])
    )
    for features, seconds in vllm_points:
        assert model.predict(model.vllm, features) == pytest.approx(seconds, rel=0.02)
    for features, seconds in blend_points:
        assert model.predict(model.blend, features) == pytest.approx(seconds, rel=0.02)
    for _ in range(4):  # a busy machine: blends 3x as long as calibrated, vLLM's steps as ever
        for (x, y), (u, v) in zip(vllm_points[:4], blend_points, strict=True):
            model.observe(model.vllm, x, y)
            model.observe(model.blend, u, 3 * v)
    assert model.blend.residual == pytest.approx(3.0, rel=0.1)
    assert model.vllm.residual == pytest.approx(1.0, rel=0.05)
    for features, seconds in blend_points:
        assert model.predict(model.blend, features) == pytest.approx(3 * seconds, rel=0.1)
    for features, seconds in vllm_points:
        assert model.predict(model.vllm, features) == pytest.approx(seconds, rel=0.05)
    model.blend._at -= 600  # ten minutes without a blend: its correction has faded
    assert model.blend.residual == pytest.approx(1 + 2 * 0.25, rel=0.1)
    residual = model.vllm.residual
    model.observe(model.vllm, vllm_features(1, 3000), 5.0)  # a decode step says nothing
    model.observe(model.vllm, vllm_features(512, 0), 0.0)  # nor a step too short to time
    assert model.vllm.residual == pytest.approx(residual, rel=1e-6)
    assert (model.vllm.weights >= 0).all() and (model.blend.weights >= 0).all()


def test_one_outlier_moves_the_residual_as_four_times_its_forecast_would() -> None:
    """A blend 100x its forecast (a machine out of memory) does not turn the server away."""
    model, _, blend_points = _calibrated(
        np.array([0.01, 2e-3, 0.5]), np.array([0.05, 3e-3, 0.75, 1e-4])
    )
    for _ in range(4):
        for features, seconds in blend_points:
            model.observe(model.blend, features, seconds)
    assert model.blend.residual == pytest.approx(1.0, rel=0.02)
    features, seconds = blend_points[-1]
    model.observe(model.blend, features, 100 * seconds)
    capped = model.blend.residual
    assert 1.2 < capped < 2.0  # as one run 4x its forecast: below the 0.8 margin's reach
    other, _, _ = _calibrated(np.array([0.01, 2e-3, 0.5]), np.array([0.05, 3e-3, 0.75, 1e-4]))
    for _ in range(4):
        for f, s in blend_points:
            other.observe(other.blend, f, s)
    other.observe(other.blend, features, 4 * seconds)
    assert capped == pytest.approx(other.blend.residual, rel=1e-4)
    model.observe(model.blend, features, 0.0001 * seconds)  # nor can one absurdly fast run
    assert model.blend.residual > 0.5


def test_a_blend_must_win_by_the_margin() -> None:
    model, _, _ = _calibrated(np.array([0.0, 1e-3, 0.0]), np.array([0.0, 1e-3, 0.0, 0.0]))
    win = model.forecast(2000, 0, 1400)  # 0.7 of vLLM's time
    assert win.blend_wins
    close = model.forecast(2000, 0, 1700)  # 0.85 of vLLM's: not sure enough
    assert close.blend_s < close.vllm_s and not close.blend_wins
    model.observe(model.vllm, vllm_features(2000, 0), 1.5)  # vLLM timed, faster than thought
    assert model.forecast(2000, 0, 1400).vllm_s == pytest.approx(1.5, rel=0.3)


def test_a_forecast_counts_the_last_tokens_step_and_the_prefix_hit() -> None:
    model = CostModel()
    model.calibrate(
        [(vllm_features(n, 0), 1e-3 * n) for n in (128, 512, 2048)],
        [(blend_features(n, 4 * n), 1e-3 * n) for n in (128, 512, 2048)],
    )
    forecast = model.forecast(4000, 0, 1000)
    assert forecast.blend_wins and forecast.vllm_s == pytest.approx(4.0, rel=0.05)
    assert forecast.blend_s == pytest.approx(1.0 + 1e-3, rel=0.05)
    assert not model.forecast(4000, 3500, 1000).blend_wins  # vLLM computes 500 only
    step = step_features([(1, 4000), (256, 0)])
    assert step[0] == 1 and step[1] == 257


WORDS = "alpha beta gamma delta river stone cloud maple copper".split()
TEXTS = [" ".join(random.Random(i).choice(WORDS) for _ in range(40)) + "." for i in range(3)]


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    model = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore())
    model.precompute(TEXTS)
    return model


class _PagedLayer:
    def __init__(self, kv_heads: int, head_dim: int, blocks: int) -> None:
        self.kv_cache = torch.zeros(blocks, 2, BLOCK, kv_heads, head_dim)
        self.impl = self

    def do_kv_cache_update(self, layer: Any, key: Any, value: Any, cache: Any, slots: Any) -> None:
        flat = cache.view(cache.shape[0], 2, BLOCK, -1)
        for row, slot in enumerate(slots.tolist()):
            flat[slot // BLOCK, 0, slot % BLOCK] = key[row].reshape(-1)
            flat[slot // BLOCK, 1, slot % BLOCK] = value[row].reshape(-1)


def _worker(engine: BlendEngine, slice_s: float) -> tuple[Worker, list[_PagedLayer]]:
    shape = engine.decoder.shape
    layers = [_PagedLayer(shape.num_kv_heads, shape.head_dim, 64) for _ in range(shape.num_layers)]
    decoder: Any = engine.decoder  # as `VLLMAdapter` without tensor parallelism
    decoder.attention_layers, decoder.tp_size = layers, 1
    decoder.kv_heads = slice(0, shape.num_kv_heads)
    decoder.gather_ranks = lambda values: values.float().reshape(1, -1)
    worker = Worker(ConnectorSettings(slice_s=slice_s, parity=False, when="always"), None, None)
    worker.register(lambda: WorkerModel(decoder, engine.library, BLOCK))
    return worker, layers


def test_a_blend_in_slices_writes_what_a_blend_in_one_go_writes(engine: BlendEngine) -> None:
    texts = TEXTS[::-1]
    prompt = "".join(s.text for s in engine.rag_segments("Which river?", texts))
    ids = engine.encode(prompt)
    plan = plan_request(engine.library, ids, 0, BlendConfig(**TOY))
    assert plan.fallback is None
    blocks = list(range(2, 2 + len(ids) // BLOCK + 1))
    written = []
    for slice_s in (1e-6, 60.0):  # a layer per step, then all in one step
        worker, layers = _worker(engine, slice_s)
        job = BlendJob("r", plan.plan, BlendConfig(**TOY), 0, len(ids) - 1, blocks)
        worker.start(StepMetadata(jobs=[job]))
        steps = 1
        while not worker.transfers()[0]:
            worker.bind()
            worker.start(StepMetadata(step=[(1, 100)]))  # another request's decode step
            steps += 1
        report = worker.report()
        assert report is not None and len(report.steps) == steps - 1  # each forward timed
        (outcome,) = report.outcomes
        assert outcome.error is None and outcome.rows > 0 and outcome.compute_s > 0
        assert steps > engine.decoder.shape.num_layers if slice_s < 1 else steps == 1
        written.append([layer.kv_cache.clone() for layer in layers])
    for sliced, whole in zip(*written, strict=True):
        torch.testing.assert_close(sliced, whole, atol=0, rtol=0)


def test_a_blend_cancelled_mid_way_is_reported_done_and_writes_no_more(
    engine: BlendEngine,
) -> None:
    texts = TEXTS
    ids = engine.encode("".join(s.text for s in engine.rag_segments("Which?", texts)))
    plan = plan_request(engine.library, ids, 0, BlendConfig(**TOY))
    worker, layers = _worker(engine, 1e-6)
    blocks = list(range(2, 2 + len(ids) // BLOCK + 1))
    worker.start(StepMetadata(jobs=[BlendJob("c", plan.plan, BlendConfig(**TOY), 0,
                                             len(ids) - 1, blocks)]))  # fmt: skip
    assert worker.transfers() == (set(), set())
    worker.start(StepMetadata(stop=["c"]))
    done, failed = worker.transfers()
    assert done == {"c"} and failed == set()  # vLLM may free its blocks now
    report = worker.report()
    assert report is not None and report.outcomes[0].cancelled
    assert not any(layer.kv_cache.any() for layer in layers)  # stopped before writing
    with pytest.raises(BlendCancelledError):
        raise BlendCancelledError("checked: the error the blend stops with")
