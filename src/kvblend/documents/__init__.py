"""Documents: their KV computed once, kept in the store, and found again in prompts.

`library.DocumentLibrary` wires `segment_kv` (the store entries of document KV, computed by
`precompute`, read a layer at a time through `stored_rows`) to the `registry` of known
documents (its `records` in the store's logs, its `anchors` hashing a prompt's windows).
"""
