"""FlexAttention as CUDA runs it, outside a compiled step: a bounded number of kernels.

The eager loop on CUDA attends sparse rows with FlexAttention compiled per shape, so the
shapes are few whatever the prompts: the K/V buffer is a `key_bucket` long and the queries a
`query_bucket` (blocks past the rows visit no key). On the CPU the compiled kernel runs on the
CPU's inductor (``COMPILED_DEVICES`` gets ``"cpu"``), on CUDA (``--device cuda``) on the GPU,
through ``engine.prefill``: fifty prompts of fifty lengths from 512 to 16K tokens make at most
four kernels per key bucket, and never the unfused eager kernel (it warns); a compile dynamo
refuses (its recompile limit) is logged once, counted in the stats, and the rows attend by
query chunks instead, with the same logits.
"""

from __future__ import annotations

import logging
import random
import warnings

import pytest
import torch

from kvblend import BlendConfig, Segment
from kvblend.bench.speed.ops import byte_engine, random_documents
from kvblend.blend.attention import flex
from kvblend.blend.attention.flex import BLOCK, MIN_KEYS, key_bucket, query_bucket

HEAD = "Answer from the documents.\n"
#: Blend the toy documents whatever their size (the default recomputes short ones whole).
BLEND = BlendConfig(short_document=0, min_recompute=0, full_above=1.0)


def test_buckets_hold_their_sizes_in_whole_blocks_and_are_few() -> None:
    keys = {key_bucket(n) for n in range(1, 70_000)}
    assert all(k >= MIN_KEYS and k & (k - 1) == 0 for k in keys) and len(keys) == 8  # 1K..128K
    for n in range(1, 70_000, 97):
        k = key_bucket(n)
        assert n <= k and (k == MIN_KEYS or k < 2 * n)
        for count in (1, n // 9 + 1, n // 5 + 1, n // 3 + 1, (n + 1) // 2, n):
            q = query_bucket(count, k)
            assert count <= q <= k and q % BLOCK == 0
            assert q in {max(BLOCK, k >> s) for s in range(4)}


def _prompt(documents: list[str], tokens: int) -> list[Segment]:
    """A RAG prompt of exactly ``tokens`` tokens (a byte tokenizer: one token per character)."""
    count = (tokens - 100) // 256
    filler = tokens - 1 - len(HEAD) - 256 * count - len("Question: ")
    return [
        Segment(HEAD, role="prefix"),
        *(Segment(text + "\n") for text in documents[:count]),
        Segment("Question: " + "x" * filler, cache=False),
    ]


@pytest.fixture
def flex_device(compute_device: torch.device, monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """The CUDA path: FlexAttention for sparse rows, its compiled kernel (on the CPU too)."""
    monkeypatch.setenv("KVBLEND_ATTENTION", "flex")
    monkeypatch.setattr(flex, "COMPILED_DEVICES", {"cuda", "cpu"})
    torch._dynamo.reset()
    return compute_device


@pytest.mark.slow
def test_fifty_prompt_lengths_compile_at_most_four_kernels_per_key_bucket(
    flex_device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch._dynamo.utils import counters

    engine = byte_engine(2, hidden=32, device=str(flex_device))
    documents = random_documents(64, 255, seed=3)
    engine.precompute([text + "\n" for text in documents], progress=False)
    lengths = sorted([512, 16_383, *random.Random(0).sample(range(513, 16_383), 48)])
    buckets = set()
    counters.clear()
    results = {}
    with warnings.catch_warnings():
        # the unfused eager kernel says so in a warning: it must never run
        warnings.filterwarnings("error", message=".*without torch.compile")
        for tokens in lengths:
            out = engine.prefill(_prompt(documents, tokens), BLEND)
            assert out.stats.prompt_tokens == tokens and out.stats.uncompiled_calls == 0
            assert 0 < out.stats.recomputed_tokens < out.stats.moved_tokens
            buckets.add(key_bucket(tokens))
            results[tokens] = out.logits
    graphs = counters["stats"]["unique_graphs"]
    assert len(buckets) == 5 and 0 < graphs <= 4 * len(buckets)  # the documented bound
    monkeypatch.setenv("KVBLEND_ATTENTION", "chunks")  # the eager CPU loop's attention
    tolerance = 2e-5 if flex_device.type == "cpu" else 2e-4  # generated kernels' sum order
    for tokens in lengths[::16]:
        expected = engine.prefill(_prompt(documents, tokens), BLEND).logits
        torch.testing.assert_close(results[tokens], expected, atol=tolerance, rtol=0)


def test_a_refused_compile_is_logged_once_counted_and_attended_by_chunks(
    flex_device: torch.device, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(flex, "FLEX_RECOMPILE_LIMIT", 2)  # the first prompt's two kernels
    monkeypatch.setattr(flex, "COMPILE_REFUSALS", flex.CompileRefusals())
    engine = byte_engine(2, hidden=32, device=str(flex_device))
    documents = random_documents(12, 255, seed=4)
    engine.precompute([text + "\n" for text in documents], progress=False)
    prompts = [_prompt(documents, 900), _prompt(documents, 2500), _prompt(documents, 3000)]
    with caplog.at_level(logging.WARNING, logger=flex.__name__):
        got = [engine.prefill(prompt, BLEND) for prompt in prompts]
    assert got[0].stats.uncompiled_calls == 0  # the first shapes compile
    assert got[1].stats.uncompiled_calls > 0 and got[2].stats.uncompiled_calls > 0
    refused = [r for r in caplog.records if "compiler refused" in r.getMessage()]
    assert len(refused) == 1  # said once, whatever the number of calls
    assert flex.COMPILE_REFUSALS.refused >= 2
    monkeypatch.setenv("KVBLEND_ATTENTION", "chunks")
    tolerance = 2e-5 if flex_device.type == "cpu" else 2e-4
    for prompt, out in zip(prompts, got, strict=True):
        expected = engine.prefill(prompt, BLEND).logits
        torch.testing.assert_close(out.logits, expected, atol=tolerance, rtol=0)


def test_a_kernel_the_backend_refuses_is_attended_by_chunks(
    flex_device: torch.device, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Any error of the kernel's compile (injected: a lowering the backend refuses) never
    reaches the caller: that shape is attended by query chunks, logged once, counted, and not
    compiled again."""
    from torch._inductor.exc import LoweringException

    tries: list[int] = []

    def refused(*args: object, **kwargs: object) -> torch.Tensor:
        tries.append(1)
        raise LoweringException(NotImplementedError("not for this shape"), "flex", [], {})

    monkeypatch.setattr(flex, "_compiled_flex", lambda: refused)
    monkeypatch.setattr(flex, "COMPILE_REFUSALS", flex.CompileRefusals())
    engine = byte_engine(2, hidden=32, device=str(flex_device))
    documents = random_documents(4, 255, seed=4)
    engine.precompute([text + "\n" for text in documents], progress=False)
    prompt = _prompt(documents, 900)
    with caplog.at_level(logging.WARNING, logger=flex.__name__):
        got = [engine.prefill(prompt, BLEND) for _ in range(2)]
    shapes = len(flex.COMPILE_REFUSALS.buckets)
    assert shapes >= 1 and len(tries) == shapes  # each shape tried once
    assert all(out.stats.uncompiled_calls > 0 for out in got)
    said = [r for r in caplog.records if "compiler refused" in r.getMessage()]
    assert len(said) == 1 and "not for this shape" in said[0].getMessage()
    monkeypatch.setenv("KVBLEND_ATTENTION", "chunks")
    expected = engine.prefill(prompt, BLEND).logits
    for out in got:
        torch.testing.assert_close(out.logits, expected, atol=1e-5, rtol=0)
