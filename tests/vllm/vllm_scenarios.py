"""Run a list of prompt batches through one vLLM engine; write what came back as JSON.

Run with the vLLM environment's interpreter (``.venv-vllm/bin/python tests/vllm/vllm_scenarios.py
JOB.json RESULT.json``); `tests/vllm/test_vllm.py` writes the job and checks the result. The job:
``{"model": folder, "dtype": "float32" (default) or another of vLLM's dtypes, "max_model_len": n,
"kv_transfer_config": {...} or null,
"tensor_parallel_size": n (optional), "steps": [...]}``;
each step: ``{"name", "prompts": [...], "max_tokens", "kv_transfer_params": {...} or null,
"one_at_a_time": bool, "reset_prefix_cache": bool, "kill_pid": pid or null, "abort": [...] or
null, "preempt": bool, "logprobs": n or null, "refused": bool}`` (``refused``: the engine is
expected to refuse the request; its error is the result); the job may name
``logits_processors``, ``log_stats`` (vLLM's metrics on: ``metrics`` in a step records the
kvblend metrics before and after it) and ``check_uses`` (`kvblend.vllm.compat.check_uses` on
this vLLM). Every prompt's result: the generated text and token ids,
``num_cached_tokens``, ``kv_transfer_params`` and the top-``logprobs`` of each generated
token.

Two steps drive the engine request by request (`vllm.LLM.llm_engine`): ``abort`` cancels each
prompt, one at a time, either ``"soon"`` (``abort_after_s`` after it was added: while its blend
runs, on any machine where a blend takes longer) or after its ``"first_token"``; ``preempt``
adds every prompt, waits for each one's first token, then preempts every running request
(``reset_prefix_cache(reset_running_requests=True)``: vLLM's own preemption, which frees their
blocks and drops its prefix cache) and lets them finish.
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
    logprobs = [
        {str(token): float(entry.logprob) for token, entry in position.items()}
        for position in (completion.logprobs or [])
    ]
    return {
        "text": completion.text,
        "token_ids": list(completion.token_ids),
        "num_cached_tokens": output.num_cached_tokens,
        "kv_transfer_params": output.kv_transfer_params,
        "logprobs": logprobs,
    }


def _run_step(llm: Any, step: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    extra = (
        {"kv_transfer_params": step["kv_transfer_params"]}
        if step.get("kv_transfer_params")
        else None
    )
    params = SamplingParams(
        temperature=0.0, max_tokens=step.get("max_tokens", 12), extra_args=extra,
        logprobs=step.get("logprobs"),
    )  # fmt: skip
    if step.get("kill_pid"):
        os.kill(int(step["kill_pid"]), signal.SIGKILL)
        time.sleep(0.5)
    if step.get("reset_prefix_cache"):
        llm.reset_prefix_cache()
    prompts = step["prompts"]
    if step.get("abort"):
        return _aborted(llm, step, params)
    if step.get("preempt"):
        return _preempted(llm, step, params)
    if step.get("refused"):  # the frontend refuses the request: say what it said
        try:
            llm.generate(prompts, params, use_tqdm=False)
        except Exception as error:  # noqa: BLE001 - the refusal is the result
            return [{"error": f"{type(error).__name__}: {error}"}]
        return [{"error": None}]
    if not step.get("one_at_a_time"):
        return [_result(out) for out in llm.generate(prompts, params, use_tqdm=False)]
    results = []
    for prompt in prompts:
        if step.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        results.append(_result(llm.generate([prompt], params, use_tqdm=False)[0]))
    return results


def _aborted(llm: Any, step: dict[str, Any], params: Any) -> list[dict[str, Any]]:
    """Add each prompt and cancel it (see the module's docstring); return what it had made."""
    engine, results = llm.llm_engine, []
    for index, (prompt, when) in enumerate(zip(step["prompts"], step["abort"], strict=True)):
        request_id = f"{step['name']}-{index}"
        engine.add_request(request_id, prompt, params)
        tokens: list[int] = []
        if when == "soon":
            time.sleep(float(step.get("abort_after_s", 0.2)))
        while when == "first_token" and not tokens:
            for out in engine.step():
                if out.request_id == request_id:
                    tokens = list(out.outputs[0].token_ids)
        engine.abort_request([request_id])
        while engine.has_unfinished_requests():
            engine.step()
        results.append({"aborted": when, "token_ids": tokens})
    return results


def _preempted(llm: Any, step: dict[str, Any], params: Any) -> list[dict[str, Any]]:
    """Run the prompts, preempting every running request once (see the module's docstring)."""
    engine = llm.llm_engine
    ids = [f"{step['name']}-{index}" for index in range(len(step["prompts"]))]
    for request_id, prompt in zip(ids, step["prompts"], strict=True):
        engine.add_request(request_id, prompt, params)
    started: set[str] = set()
    done: dict[str, Any] = {}
    while len(started | set(done)) < len(ids):
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                started.add(out.request_id)
            if out.finished:
                done[out.request_id] = out
    llm.reset_prefix_cache(reset_running_requests=True)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [_result(done[request_id]) for request_id in ids]


def _kvblend_metrics(llm: Any) -> dict[str, float]:
    """Return vLLM's kvblend metrics now (``name{label=value}``: value; a histogram's count and
    sum as ``name_count`` and ``name_sum``)."""
    values: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith("vllm:kvblend_"):
            continue
        extra = {k: v for k, v in metric.labels.items() if k not in ("engine", "model_name")}
        key = metric.name + "".join(f"{{{k}={v}}}" for k, v in sorted(extra.items()))
        if hasattr(metric, "count"):  # a histogram
            values[f"{key}_count"] = values.get(f"{key}_count", 0) + float(metric.count)
            values[f"{key}_sum"] = values.get(f"{key}_sum", 0) + float(metric.sum)
        else:
            values[key] = values.get(key, 0) + float(metric.value)
    return values


def main(job_path: str, result_path: str) -> None:
    from vllm import LLM

    with open(job_path, encoding="utf-8") as handle:
        job = json.load(handle)
    started = time.perf_counter()
    parallel: dict[str, Any] = {}
    if job.get("tensor_parallel_size", 1) > 1:  # ranks in processes of their own
        parallel = {"tensor_parallel_size": job["tensor_parallel_size"],
                    "distributed_executor_backend": "mp"}  # fmt: skip
    llm = LLM(
        model=job["model"], dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", 4096),
        enforce_eager=True, enable_prefix_caching=True, seed=0,
        kv_transfer_config=job.get("kv_transfer_config"), **parallel,
        logits_processors=job.get("logits_processors"),
        disable_log_stats=not job.get("log_stats", False),
    )  # fmt: skip
    results: dict[str, Any] = {"startup_s": time.perf_counter() - started, "steps": {}}
    if job.get("check_uses"):  # kvblend's uses of vLLM beyond its public API, on this vLLM
        import vllm
        from kvblend.vllm import compat

        results["uses"] = {"version": vllm.__version__, "checked_on": list(compat.CHECKED_ON),
                           "changed": compat.check_uses(), "count": len(compat.USES)}  # fmt: skip
    for step in job["steps"]:
        began = time.perf_counter()
        before = _kvblend_metrics(llm) if step.get("metrics") else None
        results["steps"][step["name"]] = _run_step(llm, step)
        results[f"{step['name']}_s"] = time.perf_counter() - began
        if before is not None:  # what the step added to each metric
            after = _kvblend_metrics(llm)
            added = {key: after[key] - before.get(key, 0.0) for key in after}
            results.setdefault("metrics", {})[step["name"]] = added
    with open(result_path, "w", encoding="utf-8") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
