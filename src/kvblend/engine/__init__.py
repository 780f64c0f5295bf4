"""The engine: `BlendEngine`, the facade that wires prompts, documents, the blend and decoding.

`kvblend.engine.engine.BlendEngine` builds an engine over one model and store and runs its
prompts; `results` holds what a prefill returns, `explain` what it would do and why,
`torch_threads` torch's CPU thread count for the process.
The engine is pure torch + transformers: no disk and no frameworks (the store is passed in).
"""
