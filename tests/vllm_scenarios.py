"""Run a list of prompt batches through one vLLM engine; write what came back as JSON.

Run with the vLLM environment's interpreter (``.venv-vllm/bin/python tests/vllm_scenarios.py
JOB.json RESULT.json``); `tests/test_vllm.py` writes the job and checks the result. The job:
``{"model": folder, "max_model_len": n, "kv_transfer_config": {...} or null, "steps": [...]}``;
each step: ``{"name", "prompts": [...], "max_tokens", "kv_transfer_params": {...} or null,
"one_at_a_time": bool, "reset_prefix_cache": bool, "kill_pid": pid or null}``. Every prompt's
result: the generated text and token ids, ``num_cached_tokens`` and ``kv_transfer_params``.
vLLM spawns its engine core, hence the ``__main__`` guard.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def _result(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "kv_transfer_params": output.kv_transfer_params,
    }


def _run_step(llm: Any, step: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    extra = (
        {"kv_transfer_params": step["kv_transfer_params"]}
        if step.get("kv_transfer_params")
        else None
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=step.get("max_tokens", 12), extra_args=extra
    )
    if step.get("kill_pid"):
        os.kill(int(step["kill_pid"]), signal.SIGKILL)
        time.sleep(0.5)
    if step.get("reset_prefix_cache"):
        llm.reset_prefix_cache()
    prompts = step["prompts"]
    if not step.get("one_at_a_time"):
        return [_result(out) for out in llm.generate(prompts, params, use_tqdm=False)]
    results = []
    for prompt in prompts:
        if step.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        results.append(_result(llm.generate([prompt], params, use_tqdm=False)[0]))
    return results


def main(job_path: str, result_path: str) -> None:
    from vllm import LLM

    with open(job_path, encoding="utf-8") as handle:
        job = json.load(handle)
    started = time.perf_counter()
    llm = LLM(
        model=job["model"], dtype="float32", max_model_len=job.get("max_model_len", 4096),
        enforce_eager=True, enable_prefix_caching=True, seed=0,
        kv_transfer_config=job.get("kv_transfer_config"),
    )  # fmt: skip
    results: dict[str, Any] = {"startup_s": time.perf_counter() - started, "steps": {}}
    for step in job["steps"]:
        began = time.perf_counter()
        results["steps"][step["name"]] = _run_step(llm, step)
        results[f"{step['name']}_s"] = time.perf_counter() - began
    with open(result_path, "w", encoding="utf-8") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
