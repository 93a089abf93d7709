"""The trainer's forward on every model family users train (tiny random models built from transformers
configs): its logprobs and entropies equal the model's own logits' on padded rows, on packed rows (with
sliding windows shorter than the sequences), and with the LM head in chunks, gradients included."""

import pytest
import torch

from offline.families import FAMILIES, save_family_model
from workers.forward import ForwardSettings, MicroBatch, token_logprobs_and_entropy
from workers.layout import rows_to_batch, pack
from workers.loading import load_causal_lm

WINDOW = 8  # shorter than the sequences below, so sliding-window layers really slide


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("families")
    dirs = {}
    for family in FAMILIES:
        window = {"sliding_window": WINDOW} if family in ("mistral", "gemma2", "gemma3") else {}
        dirs[family] = save_family_model(family, tiny_model_dir, root / family, **window)
    return dirs


def _batch():
    generator = torch.Generator().manual_seed(0)
    lengths = (27, 19, 23)
    rows = [{"input_ids": torch.randint(3, 290, (n,), generator=generator).tolist(),
             "action_mask": [0] * 6 + [1] * (n - 6)} for n in lengths]
    return rows_to_batch(rows, pad_token_id=1)


def _reference(model, batch, temperature):
    """Logprobs and entropies from the model's own logits, one sequence at a time (no padding, no packing)."""
    logprobs = torch.zeros(batch["input_ids"].shape)
    entropy = torch.zeros(batch["input_ids"].shape)
    for row in range(len(batch["input_ids"])):
        length = int(batch["attention_mask"][row].sum())
        ids = batch["input_ids"][row, :length][None]
        logits = model(input_ids=ids).logits[0, :-1].float() / temperature
        log_probs = torch.log_softmax(logits, -1)
        logprobs[row, 1:length] = log_probs.gather(-1, ids[0, 1:, None]).squeeze(-1)
        entropy[row, 1:length] = -(log_probs.exp() * log_probs).sum(-1)
    mask = batch["action_mask"].float()
    return logprobs * mask, entropy * mask


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forward_matches_the_models_logits_in_every_layout(family, family_dirs):
    model = load_causal_lm(family_dirs[family]).eval()
    batch = _batch()
    with torch.no_grad():
        expected_logprobs, expected_entropy = _reference(model, batch, temperature=0.7)
        chunked = ForwardSettings(logits_chunk=5, unchunked_logits_max_bytes=0)  # chunks however small the logits
        for layout in (batch, pack(batch), MicroBatch(pack(batch), chunked)):
            logprobs, entropy = token_logprobs_and_entropy(model, layout, 0.7, actions_only=True)
            torch.testing.assert_close(logprobs, expected_logprobs, atol=1e-5, rtol=0)
            torch.testing.assert_close(entropy, expected_entropy, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_chunked_head_gives_the_same_gradients(family, family_dirs):
    model = load_causal_lm(family_dirs[family])
    batch = pack(_batch())
    grads = []
    for chunk in (0, 4):
        model.zero_grad()
        settings = ForwardSettings(logits_chunk=chunk, unchunked_logits_max_bytes=0)
        logprobs, entropy = token_logprobs_and_entropy(model, MicroBatch(batch, settings), actions_only=True)
        (logprobs.sum() + 0.1 * entropy.sum()).backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-5)


def test_the_head_runs_in_chunks_only_where_the_logits_are_large():
    from workers.forward import head_chunk

    assert head_chunk(6144, 1360, 1024) == 0  # the gpu86m micro-batch: 33 MB of logits, whole
    assert head_chunk(4096, 151_936, 1024) == 1024  # Qwen's vocabulary: 2.5 GB of logits, in chunks
    assert head_chunk(8192, 32_000, 1024) == 1024  # one 8k-token response of a 32k vocabulary: 1 GB
    assert head_chunk(4096, 151_936, 0) == 0 and head_chunk(512, 151_936, 1024) == 0  # off; one chunk anyway
    assert head_chunk(100, 1360, 16, unchunked_max_bytes=0) == 16
