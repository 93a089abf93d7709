"""Shared fixtures: a tiny randomly initialised GPT-2 and its tokenizer, built once per session."""

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite is the CPU build: gloo ranks and CPU engines, also on a GPU machine (scripts/gpu_check.sh
# covers the GPU). Hiding the devices before torch first touches CUDA reaches every subprocess too.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

TINY_TEXTS = [
    "the old man walked to the market and felt happy.",
    "she smiled at the bright morning sun.",
    "the dark room was cold and sad.",
    "he laughed, and the children laughed with him.",
    "a terrible storm broke the quiet night.",
    "we found a wonderful little house by the river.",
] * 40


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Directory with a random 2-layer GPT-2 and a byte-level BPE tokenizer (pad != eos)."""
    from offline.assets import init_tiny_gpt2, train_tokenizer

    out = tmp_path_factory.mktemp("tiny_model")
    tokenizer = train_tokenizer(TINY_TEXTS, out, vocab_size=300)
    init_tiny_gpt2(tokenizer, n_layer=2, n_embd=32, n_head=2, n_positions=64).save_pretrained(out)
    return str(out)
