"""The compiled layer loop (``KVBLEND_COMPILE=1``) and FlexAttention's block mask.

The compiled loop is the eager loop's step under ``torch.compile(fullgraph=True)`` (a graph
break raises), over size buckets: prompts of one bucket reuse its graphs (dynamo's counters
say so) and give the eager loop's logits, which the exactness tests hold to transformers'
forward. The block mask FlexAttention reads (built on the device from the sorted rows, never
evaluated element by element) is checked block by block against the dense mask.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch._inductor.exc import LoweringException

from conftest import TOY_BLEND_SETTINGS, make_tiny_engine
from kvblend import BlendConfig, BlendEngine, Segment
from kvblend.bench.speed.ops import byte_engine, rag_prompt, random_documents
from kvblend.blend import compiled as compiled_loop
from kvblend.blend.attention import flex
from kvblend.blend.attention.flex import BLOCK, FlexRows, block_mask_data, size_bucket
from kvblend.blend.attention.rows import attention_mask, sdpa
from kvblend.blend.correction import apply_correction
from kvblend.blend.layer_step import layer_step
from kvblend.blend.rope import rotate_

DOCS = [
    "Doc one: Marta Quill lives in Lisbon and keeps bees on the roof of her old house.",
    "Doc two: the orange cat sleeps all day by the kitchen window, then eats at night.",
    "Doc three: a meeting at 9:30 in room 12 on Monday; bring the slides and the notes.",
]
QUESTIONS = ["Where does Marta live?", "Who keeps bees?", "When is the meeting?", "Which cat?"]
CONFIGS = [
    BlendConfig("reuse"),
    BlendConfig(**TOY_BLEND_SETTINGS),  # the default: a probe, then the chosen rows
    BlendConfig("cacheblend", recompute_ratio=0.3),  # narrowed on the device at layer 1
    BlendConfig("epic", epic_tokens=4),
    BlendConfig("full"),
]


def _prompt(order: tuple[int, ...], question: str) -> list[Segment]:
    return [
        Segment("System: answer from the documents.\n", role="prefix"),
        *(Segment(DOCS[index]) for index in order),
        Segment(f"\nQuestion: {question}\nAnswer:", cache=False),
    ]


def _dense_allowed(rows: torch.Tensor, keys: int, window: int | None) -> torch.Tensor:
    key = torch.arange(keys)[None]
    allowed = key <= rows[:, None]
    if window is not None:
        allowed &= key > rows[:, None] - window
    return allowed


@pytest.mark.parametrize("window", [None, 200])
@pytest.mark.parametrize("seed", range(6))
def test_the_block_mask_visits_every_allowed_key_and_calls_full_only_full_blocks(
    window: int | None, seed: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    total = int(torch.randint(300, 1100, (1,), generator=generator))
    count = int(torch.randint(1, total // 2, (1,), generator=generator))
    rows = torch.randperm(total - 1, generator=generator)[: count - 1].sort().values
    rows = torch.cat([rows, torch.tensor([total - 1])])  # the last row is always computed
    padded = torch.cat([rows, rows[-1:].expand(size_bucket(count) - count)])
    keys = size_bucket(total + 1)
    partial, indices, full, full_indices = (
        x[0, 0] for x in block_mask_data(padded, keys // BLOCK, window)
    )
    allowed = _dense_allowed(padded, keys, window)
    for block in range(padded.numel() // BLOCK):
        tile = allowed[block * BLOCK : (block + 1) * BLOCK].view(BLOCK, keys // BLOCK, BLOCK)
        visited = set(indices[block, : partial[block]].tolist())
        whole = set(full_indices[block, : full[block]].tolist())
        assert not visited & whole
        needed = {int(j) for j in tile.any(dim=2).any(dim=0).nonzero()}
        assert needed <= visited | whole  # every allowed key is read
        assert all(bool(tile[:, j].all()) for j in whole)  # a full block masks nothing


def test_compiled_flex_attention_equals_dense_attention() -> None:
    """One FlexAttention call over the device-built block mask (compiled, as on CUDA) equals
    SDPA with the dense mask, with rows starting in the first key block and padding rows."""
    from torch.nn.attention.flex_attention import flex_attention

    heads, kv_heads, dim, keys = 4, 2, 16, 640
    rows = torch.tensor([36, 37, 38, 159, 160, 321, 322, *range(480, 521)])
    padded = torch.cat([rows, torch.full((128 - rows.numel(),), 521)])
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(heads, 128, dim, generator=generator)
    k = torch.randn(kv_heads, keys, dim, generator=generator)
    v = torch.randn(kv_heads, keys, dim, generator=generator)
    flex = FlexRows(padded, keys, {None}, 0.25)
    kernel = torch.compile(flex_attention, dynamic=False)
    got = kernel(q[None], k[None], v[None], block_mask=flex.block_mask(None), scale=0.25,
                 enable_gqa=True)[0].transpose(0, 1).reshape(128, -1)  # fmt: skip
    scattered = torch.zeros(heads, keys, dim)
    scattered[:, padded] = q
    mask = attention_mask(torch.arange(keys), 0, keys, None, q.dtype)
    expected = sdpa(scattered, k, v, 0.25, mask)[padded]
    torch.testing.assert_close(got[: rows.numel()], expected[: rows.numel()], atol=1e-5, rtol=0)


def test_size_buckets_are_few_and_tight() -> None:
    sizes = {size_bucket(n) for n in range(1, 70_000)}
    assert all(size % BLOCK == 0 for size in sizes) and len(sizes) < 60
    assert all(n <= size_bucket(n) <= max(n + BLOCK, 1.25 * n) for n in range(1, 70_000, 7))


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_the_compiled_loop_equals_the_eager_one_without_recompiling(
    family: str, compute_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ten prompts of one size bucket, every strategy: the compiled loop gives the eager loop's
    logits and K/V, and after the first prompt no new graph is made (no graph break either:
    ``fullgraph=True`` raises on one). On CUDA the graphs are CUDA graphs, none skipped."""
    from torch._dynamo.utils import counters

    engine = make_tiny_engine(family, compute_device)
    engine.precompute(DOCS, progress=False)
    orders = [(2, 0, 1), (1, 2, 0), (0, 1, 2)]
    prompts = [_prompt(orders[i % 3], QUESTIONS[i % 4] + " " * (i // 4)) for i in range(10)]
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "0")
    eager = [[engine.prefill(prompt, config) for config in CONFIGS] for prompt in prompts]
    lengths = {len(result[0].token_ids) + 1 for result in eager}
    assert len({size_bucket(n) for n in lengths}) == 1 and len(lengths) > 1  # one bucket
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "1")
    tolerance = 1e-5 if compute_device.type == "cpu" else 1e-4  # generated kernels' sum order
    for index, prompt in enumerate(prompts):
        if index == 1:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0
        for config, expected in zip(CONFIGS, eager[index], strict=True):
            got = engine.prefill(prompt, config)
            assert got.stats.computed_tokens == expected.stats.computed_tokens
            assert got.stats.recomputed_tokens == expected.stats.recomputed_tokens
            torch.testing.assert_close(got.logits, expected.logits, atol=tolerance, rtol=0)
            for a, b in zip(got.keys + got.values, expected.keys + expected.values, strict=True):
                torch.testing.assert_close(a, b, atol=tolerance, rtol=0)
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    assert not counters["graph_break"]
    if compute_device.type == "cuda":  # every step replayed as a CUDA graph
        assert not counters["inductor"]["cudagraph_skips"]


@pytest.mark.parametrize("family", ["llama", "llama3-scaled", "qwen3"])
def test_the_compiled_full_prefill_equals_transformers_forward(
    family: str, compute_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "1")
    engine: BlendEngine = make_tiny_engine(family, compute_device)
    pre = engine.prefill(_prompt((0, 1, 2), QUESTIONS[0]), BlendConfig("full"))
    with torch.inference_mode():
        ids = torch.tensor([pre.token_ids], device=compute_device)
        expected = engine.model(ids).logits[0, -1].float()
    torch.testing.assert_close(pre.logits, expected, atol=1e-4, rtol=0)
    assert np.isfinite(pre.logits.cpu().numpy()).all()


@pytest.mark.parametrize(
    ("name", "value"), [("KVBLEND_COMPILE", "yes"), ("KVBLEND_ATTENTION", "dense")]
)
def test_a_loop_setting_out_of_its_choices_is_one_clear_error(
    name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_tiny_engine("qwen2")
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"^{name} must be .*, got '{value}'$"):
        engine.prefill(_prompt((0, 1, 2), QUESTIONS[0]), BlendConfig("reuse"))


@pytest.mark.slow
def test_the_compiled_step_is_one_graph_per_bucket_for_all_24_layers(
    compute_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 layers, one graph: the layer's weights are the graph's inputs, not its constants.

    ``reuse`` (one pass) makes one graph; the default (a probe, then the chosen rows with the
    stale-KV correction) one more for its main pass (the probe's rows are ``reuse``'s bucket);
    a second prompt of the same buckets none. The logits are the eager loop's. On CUDA every
    step of both passes replays as a CUDA graph (none skipped).
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    engine = byte_engine(24, hidden=32, device=str(compute_device))
    documents = random_documents(8, 200, seed=5)
    engine.precompute([text + "\n" for text in documents], progress=False)
    prompts = [rag_prompt(documents), rag_prompt(documents[::-1])]
    configs = [BlendConfig("reuse"), BlendConfig()]
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "0")
    eager = [[engine.prefill(p, c).logits for c in configs] for p in prompts]
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "1")
    graphs = []
    tolerance = 1e-5 if compute_device.type == "cpu" else 1e-4  # generated kernels' sum order
    for index, prompt in enumerate(prompts):
        for config, expected in zip(configs, eager[index], strict=True):
            got = engine.prefill(prompt, config)
            torch.testing.assert_close(got.logits, expected, atol=tolerance, rtol=0)
            assert got.stats.uncompiled_calls == 0
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 2, 2, 2]
    assert not counters["graph_break"]
    if compute_device.type == "cuda":
        assert not counters["inductor"]["cudagraph_skips"]


def test_a_refused_step_compile_runs_the_step_eagerly_counted(
    compute_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past dynamo's recompile limit the step runs eagerly, counted, with the same logits."""
    monkeypatch.setattr(compiled_loop, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(flex, "COMPILE_REFUSALS", flex.CompileRefusals())
    torch._dynamo.reset()
    engine = byte_engine(3, hidden=32, device=str(compute_device))
    documents = random_documents(4, 150, seed=6)
    engine.precompute([text + "\n" for text in documents], progress=False)
    prompt = rag_prompt(documents)
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "0")
    expected = [engine.prefill(prompt, c).logits for c in (BlendConfig("reuse"), BlendConfig())]
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "1")
    reuse = engine.prefill(prompt, BlendConfig("reuse"))  # its one graph
    default = engine.prefill(prompt, BlendConfig())  # its main pass's graph is refused
    assert reuse.stats.uncompiled_calls == 0 and default.stats.uncompiled_calls == 2
    assert flex.COMPILE_REFUSALS.refused == 2
    tolerance = 1e-5 if compute_device.type == "cpu" else 1e-4
    torch.testing.assert_close(reuse.logits, expected[0], atol=tolerance, rtol=0)
    torch.testing.assert_close(default.logits, expected[1], atol=tolerance, rtol=0)


def _lowering_refused(*args: Any) -> Any:
    """What torch 2.11's CPU inductor raises for the step's FlexAttention, before it runs."""
    error = NotImplementedError("Unsupported for now if query, key, value are the same buffer.")
    raise LoweringException(error, "flex_attention", [], {})


def _fails_halfway(*args: Any) -> Any:
    """A compiled step that runs on layer 0 (the eager step) and fails on the next layer after
    its first kernels ran (the correction moved the layer's cached rows), leaving that layer's
    K/V half-written: a retry from it would shift the moved rows twice."""
    view, _, _, hidden, layer_kv, _, row_table, correction, _ = args
    if view.layers[0] is view.model.model.layers[0]:
        return layer_step(*args)
    _, fresh = view.project_rows(0, hidden)
    rotate_(fresh[:, 0], row_table.unsqueeze(1))
    if correction is not None:  # what `write_fresh` does first
        apply_correction(correction, layer_kv, fresh)
    raise RuntimeError("injected: a kernel of the compiled step failed on its first run")


@pytest.fixture(scope="module")
def refused_setup() -> tuple[BlendEngine, list[list[Segment]], list[list[Any]]]:
    """A 3-layer engine, two prompts of one size bucket, and the eager loop's prefills of them."""
    engine = byte_engine(3, hidden=32)
    documents = random_documents(4, 150, seed=6)
    engine.precompute([text + "\n" for text in documents], progress=False)
    prompts = [rag_prompt(documents), rag_prompt(documents[::-1])]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(compiled_loop.COMPILE_ENV, "0")
        eager = [[engine.prefill(p, c) for c in REFUSED_CONFIGS] for p in prompts]
    return engine, prompts, eager


#: The default's main pass is corrected (its K/V written in place twice per layer).
REFUSED_CONFIGS = [BlendConfig("reuse"), BlendConfig()]


@pytest.mark.parametrize(("refusal", "tries"), [(_lowering_refused, 1), (_fails_halfway, 2)])
def test_a_step_the_backend_refuses_runs_eagerly_with_the_eager_answer(
    refusal: Any,
    tries: int,
    refused_setup: tuple[BlendEngine, list[list[Segment]], list[list[Any]]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refused compile (injected: a lowering error before the step runs, or a failure after
    it wrote part of the layer's K/V) never reaches the caller: that bucket runs eagerly from
    the same inputs, logged once, counted, never compiled again, and the answer is the eager
    loop's (``tries``: compiled calls per bucket)."""
    engine, prompts, eager = refused_setup
    calls: list[int] = []

    def compile_refused(device_type: str) -> Any:
        def step(*args: Any) -> Any:
            calls.append(1)
            return refusal(*args)

        return step

    monkeypatch.setattr(compiled_loop, "_compiled_step", compile_refused)
    monkeypatch.setattr(flex, "COMPILE_REFUSALS", flex.CompileRefusals())
    monkeypatch.setenv(compiled_loop.COMPILE_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=flex.__name__):
        got = [[engine.prefill(p, c) for c in REFUSED_CONFIGS] for p in prompts]
    buckets = len(flex.COMPILE_REFUSALS.buckets)
    assert buckets >= 2 and len(calls) == tries * buckets  # then never compiled again
    steps = [out.stats.uncompiled_calls for results in got for out in results]
    assert all(steps) and sum(steps) == flex.COMPILE_REFUSALS.refused  # every one counted
    for results, expected in zip(got, eager, strict=True):
        for out, reference in zip(results, expected, strict=True):
            torch.testing.assert_close(out.logits, reference.logits, atol=1e-5, rtol=0)
            for a, b in zip(out.keys + out.values, reference.keys + reference.values, strict=True):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    said = [r.getMessage() for r in caplog.records if "compiler refused" in r.getMessage()]
    assert len(said) == 1 and ("same buffer" in said[0] or "injected" in said[0])
