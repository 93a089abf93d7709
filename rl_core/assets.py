"""Offline tiny assets: a byte-level BPE tokenizer and a GPT-2-style model built from scratch.

Nothing here touches a hub. Real users point `model.path` at `gpt2` or a local checkpoint
instead; these assets exist so the whole framework runs and is tested on a CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

PAD_TOKEN = "[PAD]"
EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer and save it as a Hugging Face fast tokenizer.

    OpenAI detail: the pad token is distinct from EOS (`[PAD]`), so padding never looks like
    the end of a document to the model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
    )
    hf_tokenizer.save_pretrained(str(out_dir))
    return hf_tokenizer


def init_tiny_gpt2(tokenizer, n_layer: int = 2, n_embd: int = 64, n_head: int = 2,
                   n_positions: int = 128, seed: int = 0):
    """A randomly initialised GPT-2 with dropout off (OpenAI detail: no dropout in RL)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)
