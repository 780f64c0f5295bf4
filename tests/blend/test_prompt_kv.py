"""Cached K/V placed a group of layers at a time, each layer waiting for its own group.

On the CPU the copy stream is the null one (copies run at once, no events), so the grouping
runs here as it does on CUDA: a recording stream checks which copies are issued and that every
layer waits for its group before it is computed, that a group's keys are rotated once as they
are placed, and every strategy's prefill is bit for bit the same with groups of one, two or
every layer.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from conftest import make_tiny_engine
from kvblend import BlendConfig, Segment
from kvblend.blend import kv_buffer as prompt_kv
from kvblend.blend import loop as blend_module
from kvblend.blend.kv_buffer import CopyStream, LayerLoads, PromptKV, group_layers
from kvblend.blend.rope import rope_table, rotate
from kvblend.blend.types import CachedSpan
from kvblend.documents.stored_rows import StoredRows
from kvblend.errors import BlendCancelledError

LAYERS, HEADS, DIM = 7, 2, 4
DOCS = [
    "Doc one: Marta Quill lives in Lisbon and keeps bees.",
    "Doc two: the orange cat sleeps all day by the window.",
    "Doc three: a meeting at 9:30 in room 12.",
]
PROMPT = [
    Segment("System: answer from the documents.\n", role="prefix"),
    *map(Segment, reversed(DOCS)),
    Segment("\nQuestion: where does Marta live?\nAnswer:", cache=False),
]
STRATEGIES = [
    BlendConfig("reuse"),
    BlendConfig("attention", recompute_ratio=0.3, min_recompute=0, full_above=1.0),
    BlendConfig("cacheblend", recompute_ratio=0.3, check_layer=1),  # every row until layer 1
    BlendConfig("cacheblend", ratio_schedule=((1, 0.5), (2, 0.2))),
    BlendConfig("epic", epic_tokens=4),
    BlendConfig("full"),
]


def _spans(generator: torch.Generator) -> tuple[list[CachedSpan], list[torch.Tensor]]:
    """Two stored entries (one read in part) placed at prompt rows 2-7 and 10-13."""
    entries = [torch.randn(LAYERS, 2, HEADS, n, DIM, generator=generator) for n in (5, 6)]

    def stored(kv: torch.Tensor, rows: slice) -> StoredRows:
        return StoredRows({"kv": kv}, rows, recompute=lambda: {"kv": kv})

    spans = [CachedSpan(2, 7, stored(entries[0], slice(0, 5))),
             CachedSpan(10, 13, stored(entries[1], slice(3, 6)))]  # fmt: skip
    return spans, [entries[0], entries[1][:, :, :, 3:6]]


def _table(length: int) -> torch.Tensor:
    """A `rope_table` of ``length`` positions (every position a different rotation)."""
    angles = torch.arange(length)[:, None] * torch.tensor([0.3, 0.05])[None]
    cos, sin = torch.cat((angles.cos(),) * 2, -1), torch.cat((angles.sin(),) * 2, -1)
    return rope_table(cos, sin)


@pytest.mark.parametrize("group", [1, 3, 4, LAYERS])
def test_groups_place_exactly_the_layers_issued(group: int) -> None:
    spans, rows = _spans(torch.Generator().manual_seed(group))
    before = [span.source.tensors["kv"].clone() for span in spans]  # the store's: never written
    kv = PromptKV(torch.full((LAYERS, 2, HEADS, 16, DIM), float("nan")), 16)
    table = _table(16)
    loads = LayerLoads(kv, spans, group, CopyStream(torch.device("cpu")), table)
    loads.issue(range(2, LAYERS))  # layers 0 and 1 compute every row: nothing placed there
    assert [loads.issued(layer) for layer in range(LAYERS)] == [False] * 2 + [True] * 5
    for layer in range(LAYERS):
        loads.wait(layer)  # the null stream: a no-op
        placed = kv.data[layer, :, :, 2:7], kv.data[layer, :, :, 10:13]
        if layer < 2:
            assert all(torch.isnan(p).all() for p in placed)
            continue
        for p, r, at in zip(placed, rows, (slice(2, 7), slice(10, 13)), strict=True):
            assert torch.equal(p[1], r[layer, 1])  # values as stored
            assert torch.equal(p[0], rotate(r[layer, 0], table[at]))  # keys rotated, once
    assert torch.isnan(kv.data[:, :, :, 7:10]).all() and torch.isnan(kv.data[:, :, :, 13:]).all()
    assert all(torch.equal(s.source.tensors["kv"], kv) for s, kv in zip(spans, before, strict=True))


def test_group_sizes_by_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert group_layers(torch.device("cpu"), 24) == 24  # synchronous copies: one group
    assert group_layers(torch.device("cuda"), 24) == prompt_kv.GROUP_LAYERS["cuda"]
    assert group_layers(torch.device("cuda"), 2) == 2
    monkeypatch.setitem(prompt_kv.GROUP_LAYERS, "cpu", 0)
    assert group_layers(torch.device("cpu"), 24) == 1


class _Recording(CopyStream):
    """The null stream, logging each copy (as a numbered event) and each wait."""

    log: list[tuple[str, Any]] = []

    def copy(self, place: Any, *args: Any) -> Any:
        place(*args, non_blocking=False)
        event = sum(1 for entry in self.log if entry[0] == "copy")
        self.log.append(("copy", (event, list(args[0]))))
        return event

    def wait(self, event: Any) -> None:
        self.log.append(("wait", event))


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Log copies and waits of every pass, and each layer's compute (`compute_layer`)."""
    log: list[tuple[str, Any]] = []
    monkeypatch.setattr(_Recording, "log", log)
    monkeypatch.setattr(prompt_kv, "CopyStream", _Recording)
    monkeypatch.setitem(prompt_kv.GROUP_LAYERS, "cpu", 2)
    real = blend_module.compute_layer

    def writing(state: Any, layer: int, *args: Any) -> Any:
        log.append(("compute", layer))
        return real(state, layer, *args)

    monkeypatch.setattr(blend_module, "compute_layer", writing)
    return log


def _events(log: list[tuple[str, Any]]) -> tuple[list[list[int]], list[int | None]]:
    """The layers of each copy, and the event each layer waited for before its compute."""
    copies = [layers for kind, (_, layers) in (e for e in log if e[0] == "copy")]
    waited: list[int | None] = []
    pending: int | None = None
    for kind, value in log:
        if kind == "wait":
            pending = value
        elif kind == "compute":
            waited.append(pending)
            pending = None
    return copies, waited


def test_each_layer_waits_for_its_own_group(recorded: list[tuple[str, Any]]) -> None:
    engine = make_tiny_engine("llama")  # 3 layers: groups [0, 1] and [2]
    engine.precompute(DOCS, progress=False)
    engine.prefill(PROMPT, BlendConfig("reuse"))  # the parity check, the prompt head's entry
    recorded.clear()
    engine.prefill(PROMPT, BlendConfig("reuse"))
    assert _events(recorded) == ([[0, 1], [2]], [0, 0, 1])
    assert recorded[:2] == [("copy", (0, [0, 1])), ("copy", (1, [2]))]  # all queued up front


def test_a_check_layer_loads_its_own_layer_then_the_rest(recorded: list[tuple[str, Any]]) -> None:
    engine = make_tiny_engine("llama")
    engine.precompute(DOCS, progress=False)
    engine.prefill(PROMPT, BlendConfig("reuse"))
    recorded.clear()
    no_prefix = PROMPT[1:]  # every token moved or uncached: computed up to the check layer
    result = engine.prefill(
        no_prefix, BlendConfig("cacheblend", recompute_ratio=0.3, check_layer=1)
    )
    assert result.stats.prefix_tokens == 0 and result.stats.reused_tokens > 0
    # layer 0 computes every row and reads no cache; layer 1 reads its own to choose rows;
    # layer 2, now computing some rows only, reads the rest
    assert _events(recorded) == ([[1], [2]], [None, 0, 1])


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_every_strategy_is_the_same_whatever_the_groups(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_tiny_engine(family)
    engine.precompute(DOCS, progress=False)
    for config in STRATEGIES:
        results = []
        for group in (1, 2, 0):  # 0: the default, one group of every layer
            if group:
                monkeypatch.setitem(prompt_kv.GROUP_LAYERS, "cpu", group)
            else:
                monkeypatch.delitem(prompt_kv.GROUP_LAYERS, "cpu", raising=False)
            results.append(engine.prefill(PROMPT, config))
        first = results[0]
        assert first.stats.reused_tokens > 0 or config.strategy == "full"
        for other in results[1:]:
            assert torch.equal(other.logits, first.logits), config
            assert all(torch.equal(a, b) for a, b in zip(other.keys, first.keys, strict=True))
            assert all(torch.equal(a, b) for a, b in zip(other.values, first.values, strict=True))


def test_a_cancelled_pass_fences_every_copy_before_its_buffer_is_handed_back(
    recorded: list[tuple[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass stopped after layer 0 orders the compute stream after every copy it issued, the
    one of layers it never waited for included, before its buffer (a compiled loop's static
    one) can be handed to the next prompt."""
    monkeypatch.setattr(PromptKV, "release", lambda self: recorded.append(("release", None)))
    engine = make_tiny_engine("llama")  # 3 layers: copies of layers [0, 1] and [2]
    engine.precompute(DOCS, progress=False)
    engine.prefill(PROMPT, BlendConfig("reuse"))
    cancel = threading.Event()
    logged = blend_module.compute_layer  # the fixture's: logs each layer

    def stopping(state: Any, layer: int, *args: Any) -> Any:
        cancel.set()  # checked before the next layer
        return logged(state, layer, *args)

    monkeypatch.setattr(blend_module, "compute_layer", stopping)
    recorded.clear()
    with pytest.raises(BlendCancelledError):
        engine.prefill(PROMPT, BlendConfig("reuse"), cancel=cancel)
    assert recorded == [("copy", (0, [0, 1])), ("copy", (1, [2])), ("wait", 0), ("compute", 0),
                        ("wait", 0), ("wait", 1), ("release", None)]  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_part_of_a_pinned_entry_is_read_from_a_contiguous_pinned_copy() -> None:
    kv = torch.randn(3, 2, 2, 10, 4).pin_memory()
    rows = StoredRows({"kv": kv}, slice(2, 7), recompute=lambda: {"kv": kv})
    part = rows.layers()
    assert part.is_contiguous() and part.is_pinned() and torch.equal(part, kv[:, :, :, 2:7])
    whole = StoredRows({"kv": kv}, slice(0, 10), recompute=lambda: {"kv": kv}).layers()
    assert whole.data_ptr() == kv.data_ptr()  # a whole entry is read in place
