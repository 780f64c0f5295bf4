"""Whether the guard escalated, and why, reaches every adapter's ``kvblend`` metadata."""

from __future__ import annotations

import pytest

from conftest import byte_tokenizer, tiny_model
from kvblend import BlendConfig, BlendEngine
from kvblend.store import MemoryKVStore

pytest.importorskip("langchain_core")
pytest.importorskip("llama_index.core")

DOCUMENTS = [
    "Marta Quill is a beekeeper who lives in Lisbon with her three dogs.",
    "Tomas Elm makes violins in Cremona and plays them on Sundays at noon.",
]
PROMPT = f"Context:\n{DOCUMENTS[1]}\n{DOCUMENTS[0]}\nQuestion: who lives in Lisbon?"
BLEND = BlendConfig(min_recompute=0, short_document=0, full_above=1.0, lead_tokens=2)


@pytest.fixture(scope="module")
def engine() -> BlendEngine:
    engine = BlendEngine(tiny_model("llama"), byte_tokenizer(), store=MemoryKVStore(), name="tiny")
    engine.precompute(DOCUMENTS)
    return engine


def _langchain(engine: BlendEngine, config: BlendConfig) -> dict:
    from kvblend.langchain import BlendLLM

    llm = BlendLLM(engine=engine, blend_config=config, max_tokens=2)
    return llm.generate([PROMPT]).generations[0][0].generation_info["kvblend"]


def _llamaindex(engine: BlendEngine, config: BlendConfig) -> dict:
    from kvblend.llamaindex import BlendLLM

    return (
        BlendLLM(engine=engine, blend_config=config, max_tokens=2).complete(PROMPT).raw["kvblend"]
    )


@pytest.mark.parametrize("run", [_langchain, _llamaindex])
def test_the_guard_s_decision_is_in_the_metadata(engine: BlendEngine, run) -> None:  # type: ignore[no-untyped-def]
    escalated = run(engine, BLEND.replace(guard=0.0))
    assert escalated["guard"]["escalated"] and escalated["strategy_run"] == "full"
    assert escalated["fallback"].startswith("guard: the blend moved")
    kept = run(engine, BLEND.replace(guard=float("inf")))
    assert kept["guard"]["escalated"] is False and kept["fallback"] is None
    assert set(kept["guard"]["signals"]) >= {"shift", "margin"}
    assert run(engine, BLEND.replace(guard=None))["guard"] is None
