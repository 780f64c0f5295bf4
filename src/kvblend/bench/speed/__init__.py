"""Speed benchmarks on the CPU: what a prefill, a store read or a prompt's handling costs.

TTFT of every strategy by prompt length (`ttft`, summarised by `ttft_summary`) and by CPU
thread count (`threads`), batched requests (`batch`), precompute (`ingest`), prompt handling
(`planning`) and document finding (`registry`), aten ops and host syncs of a prefill (`ops`),
documents read from Redis (`redis_ttft`), checking a stored entry (`entry_check`) and what each
KV codec costs and saves (`kv_codecs`); `synthetic` writes the prose their prompts are made of.
"""
