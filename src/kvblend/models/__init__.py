"""Hugging Face models: loading, the content fingerprint and the transformers adapter.

`loading` finds and loads a causal LM (the bundled default, a folder, a hub id, a GGUF file);
`fingerprint` is the model part of every segment key; `decoder.Decoder` is the
`kvblend.blend.adapter.ModelAdapter` of a transformers model.
"""
