"""Models of a real model's shape with random weights, for timing (no trained weights needed).

``llama-1b`` and ``llama-8b`` are the shapes of Llama-3.2-1B and Llama-3.1-8B (layers, width,
heads, GQA KV heads, MLP width, vocabulary, RoPE scaling), ``qwen2.5-0.5b`` that of
Qwen2.5(-Coder)-0.5B (a Qwen2 model: biased QKV projections), for a machine that has no copy of
its weights; ``tiny`` is a two-layer Llama for tests. The weights are random, made in the compute
dtype on the device (an 8B model is 16 GB in bf16), and the tokenizer is a real one passed in
(token ids only need to be in the vocabulary).
"""

from __future__ import annotations

from typing import Any

import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

#: Config fields of each shape (a transformers LlamaConfig, or the ``model_type``'s config).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "llama-1b": {
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": True,
        "rope_parameters": LLAMA3_ROPE,
    },
    "llama-8b": {
        "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_parameters": LLAMA3_ROPE,
    },
    "qwen2.5-0.5b": {
        "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "vocab_size": 151936, "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    },
    "tiny": {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 50000, "max_position_embeddings": 65536, "tie_word_embeddings": False,
        "rope_parameters": LLAMA3_ROPE,
    },
}  # fmt: skip


def random_model(shape: str, tokenizer: Any, device: torch.device, dtype: torch.dtype) -> Any:
    """Build a model of ``shape`` with random weights on ``device`` in ``dtype``, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    fields = dict(MODEL_SHAPES[shape])
    kind = fields.pop("model_type", "llama")
    config_class, model_class = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    fields["vocab_size"] = max(fields["vocab_size"], len(tokenizer))
    config = config_class(
        **fields, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    config._attn_implementation = "sdpa"  # transformers' own SDPA attention
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = model_class(config)
    finally:
        torch.set_default_dtype(previous)
    for module in model.modules():  # small weights: activations stay in range over the layers
        if isinstance(module, torch.nn.Linear | torch.nn.Embedding):
            torch.nn.init.normal_(module.weight, std=0.02)
    return model.eval()
