"""Decoding from a blended prefill's fused cache, through transformers' own ``generate``.

`generation` decodes one prompt (streaming, stop strings, cancellation), `batch` several at
once; `options` turns decoding options into transformers' settings; `cache` is the
transformers cache that holds the blended prompt's K/V.
"""
