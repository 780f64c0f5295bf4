"""The blended prefill: one plain loop over a model's layers, through its adapter.

`prefill.run_blend` lets a strategy's selector (`selectors/`) choose the reused rows it
recomputes, then runs the pass (`loop.run_pass`), which places cached K/V at the prompt's rows
(`kv_buffer`, keys rotated by `rope`) and runs each layer's step (`layer_step`: projections,
the stale-KV `correction`, `attention/` of the computed rows, FlexAttention in
`attention.flex`), eagerly or compiled (`compiled`). It drives a model only through
`adapter.ModelAdapter`, so transformers' modules (`kvblend.models`) and vLLM's
(`kvblend.vllm`) share it. Pure torch: no tokenizers, stores or frameworks.
"""
