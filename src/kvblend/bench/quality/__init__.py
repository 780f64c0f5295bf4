"""Quality benchmarks: how far a blended answer is from full prefill's, on the same prompts.

The generated QA task (`qa`) and its benchmark (`qa_bench`), NQ-open over retrieved passages
(`nq`) run at a size that decides (`nq_eval`, with full prefill's answers kept by `baselines`),
every prompt shape in one report (`shapes`), documents precomputed behind other contexts
(`doc_context`), the guard's signals (`guard_calibration`) and the KV codecs' answers
(`codec_quality`); `compare` runs every strategy on one prompt beside full prefill and `stats`
gives the paired bootstrap intervals.
"""
