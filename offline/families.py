"""Tiny random models of the families users train (Llama, Qwen, Mistral, Phi, Gemma, MoE), built from
`transformers` configs with no download: what the tests and benchmarks run the framework on besides
the shipped GPT-2, so rotary positions, grouped-query attention, q/k norms, untied heads, soft-capping,
sliding windows and experts all go through the trainer and both engines.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Every family is 2 layers of hidden 64 with 4 query heads of 16 over 2 key/value heads (GQA), unless
# the family itself differs; `overrides` change any config field (e.g. max_position_embeddings).
_COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),  # q/k norms
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                         decoder_sparse_step=1)),
    "mistral": ("MistralConfig", {}),
    "phi3": ("Phi3Config", dict(head_dim=None)),  # fused qkv; head_dim is hidden / heads
    # Gemma: tied heads, scaled embeddings, soft-capped logits (2), sliding-window layers (2 and 3).
    # Google's Gemma 2 configs carry the activation under both names; SGLang reads `hidden_act`.
    "gemma2": ("Gemma2Config", dict(tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh")),
    "gemma3": ("Gemma3TextConfig", dict(tie_word_embeddings=True)),
}


def family_config(family: str, tokenizer, **overrides: Any):
    """A tiny `transformers` config of `family` for `tokenizer`'s vocabulary and special tokens."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of {sorted(FAMILIES)}")
    class_name, own = FAMILIES[family]
    settings = {**_COMMON, **own, **overrides}
    settings = {key: value for key, value in settings.items() if value is not None}
    return getattr(transformers, class_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **settings)


def save_family_model(family: str, tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0,
                      **overrides: Any) -> str:
    """A random `family` model with `tokenizer_dir`'s tokenizer (and chat template) saved to `out_dir`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, tokenizer, **overrides), dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return str(out_dir)
