"""workers.decode, the trainer's one decoder (SFT and DPO evaluations, the reward model's reference samples), on
every model family users train: the model's own greedy continuation, with its KV cache passed by the keyword the
installed transformers takes (no deprecated name). tests/workers/test_transformers_floor.py runs it on 5.12 too."""

import warnings

import pytest
import torch

from offline.families import FAMILIES, save_family_model
from workers.decode import DecodeSettings, decode
from workers.loading import load_causal_lm, load_tokenizer

NEW_TOKENS = 6


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("decode_families")
    return {"gpt2": tiny_model_dir, **{family: save_family_model(family, tiny_model_dir, root / family)
                                       for family in FAMILIES}}


@pytest.mark.parametrize("family", ["gpt2", *FAMILIES])
def test_greedy_decoding_is_the_models_own_continuation(family, family_dirs):
    model = load_causal_lm(family_dirs[family]).eval()
    tokenizer = load_tokenizer(family_dirs[family])
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 290, (n,), generator=generator).tolist() for n in (11, 7)]
    settings = DecodeSettings(max_new_tokens=NEW_TOKENS, eos_token_id=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated keyword would warn here
        alone = decode(model, prompts[:1], settings, tokenizer.pad_token_id, torch.device("cpu"))
        batch = decode(model, prompts, settings, tokenizer.pad_token_id, torch.device("cpu"))
    prompt = torch.tensor(prompts[:1])
    reference = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW_TOKENS,
                               do_sample=False, eos_token_id=[], pad_token_id=tokenizer.pad_token_id)
    assert alone == [reference[0, len(prompts[0]):].tolist()]
    assert [len(completion) for completion in batch] == [NEW_TOKENS, NEW_TOKENS]  # fixed length: no EOS stop
