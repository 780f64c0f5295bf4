"""The connector's worker side: the blends run inside vLLM's model runner, written into its cache.

`worker.Worker` is the one worker-side object: it takes each step's jobs, runs the blend loop
(`blending`) over vLLM's own modules (`adapter.VLLMAdapter`) in slices between vLLM's steps
(`pacing`), writes the blended K/V into vLLM's paged cache (`paged`), stores the documents it
was asked to, and times vLLM's forward and the loop once at start-up (`calibration`) for the
cost model. It never imports the scheduler side (`kvblend.vllm.scheduling`): the two meet only
in the messages of `kvblend.vllm.requests` and the modules beside it (`lint-imports` holds it).
"""
