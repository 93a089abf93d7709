"""A small random GPT-2 with the session's tiny tokenizer, sized for one engine test module."""

from pathlib import Path


def save_small_gpt2(tiny_model_dir, out: Path, *, n_layer: int, n_embd: int, n_positions: int) -> str:
    from transformers import AutoTokenizer

    from offline.assets import init_tiny_gpt2

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(out)
    init_tiny_gpt2(tokenizer, n_layer=n_layer, n_embd=n_embd, n_head=2, n_positions=n_positions).save_pretrained(out)
    return str(out)
