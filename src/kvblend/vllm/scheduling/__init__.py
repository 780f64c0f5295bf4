"""The connector's scheduler side: one `BlendRequest` per request, from its plan to its record.

`scheduler.SchedulerSide` plans each request vLLM asks about (`kvblend.vllm.request_plan`), asks the
admission policy (`kvblend.vllm.admission`) whether to blend it, claims its tokens, sends the
workers each step's jobs and learns from their reports; `records` says what became of each
request (its record, its log lines, the counts vLLM's metrics read). It never imports the
worker side (`kvblend.vllm.execution`): the two meet only in the messages of
`kvblend.vllm.requests` and the modules beside it (`lint-imports` holds it).
"""
