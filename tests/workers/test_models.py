"""Models: per-token alignment, OpenAI initialisations, last-token reward, gain/bias, no dropout, collation."""

import math

import pytest
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

from workers.forward import entropy_from_logits, logprobs_from_logits, raw_reward_scores, reward_scores, token_logprobs, token_logprobs_and_entropy, token_values
from workers.layout import rows_to_batch, padding_fraction
from workers.loading import ValueModel, init_reward_model, load_causal_lm, load_reward_model, load_tokenizer, set_reward_gain_bias


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def policy(tiny_model_dir, tokenizer):
    return load_causal_lm(tiny_model_dir)


def _batch(tokenizer, texts, n_actions=3):
    rows = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        rows.append({"input_ids": ids, "action_mask": [0] * (len(ids) - n_actions) + [1] * n_actions})
    return rows_to_batch(rows, tokenizer.pad_token_id)


def test_token_logprobs_match_manual_gather_with_temperature(policy, tokenizer):
    batch = _batch(tokenizer, ["the old man walked to the market", "she smiled"])
    temperature = 0.7
    logprobs = token_logprobs(policy, batch, temperature)
    ids = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 0)
    logits = policy(input_ids=ids, attention_mask=batch["attention_mask"]).logits
    manual = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    mask = batch["attention_mask"][:, 1:].bool()
    assert logprobs.shape == batch["input_ids"].shape
    assert torch.all(logprobs[:, 0] == 0)
    torch.testing.assert_close(logprobs[:, 1:][mask], manual[mask], atol=1e-5, rtol=1e-5)
    at_t1 = token_logprobs(policy, batch, 1.0)
    assert not torch.allclose(at_t1[:, 1:][mask], logprobs[:, 1:][mask])

    same, entropy = token_logprobs_and_entropy(policy, batch, temperature)
    torch.testing.assert_close(same, logprobs)
    probs = torch.softmax(logits[:, :-1] / temperature, dim=-1)
    manual_entropy = -(probs * torch.log(probs)).sum(-1)
    torch.testing.assert_close(entropy[:, 1:][mask], manual_entropy[mask], atol=1e-4, rtol=1e-4)


def test_action_only_logprobs_and_gradients_equal_the_full_ones_on_the_actions(policy, tokenizer):
    """`actions_only` runs the LM head from the leftmost action column on: the same numbers and the same
    gradients on the action tokens as the full pass, 0 elsewhere."""
    batch = _batch(tokenizer, ["the old man walked to the market today", "she smiled", "a cat sat on it"],
                   n_actions=2)
    batch["action_mask"][1] = 0  # a row with no action at all
    mask = batch["action_mask"].float()
    grads = []
    for actions_only in (False, True):
        policy.zero_grad()
        logprobs, entropy = token_logprobs_and_entropy(policy, batch, 0.7, actions_only=actions_only)
        if actions_only:
            assert torch.all(logprobs[mask == 0] == 0) and torch.all(entropy[mask == 0] == 0)
            torch.testing.assert_close(token_logprobs(policy, batch, 0.7, actions_only=True), logprobs)
        ((logprobs * mask).sum() + (entropy * mask).sum()).backward()
        grads.append([p.grad.clone() for p in policy.parameters()])
        if not actions_only:
            full = (logprobs * mask, entropy * mask)
    torch.testing.assert_close(logprobs, full[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(entropy, full[1], atol=1e-6, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    policy.zero_grad()


def test_left_padded_query_inside_row_matches_unpadded(policy, tokenizer):
    """OpenAI detail: exclusive-cumsum position ids make padding inside a row invisible."""
    query = tokenizer("the dark room")["input_ids"]
    response = tokenizer(" was cold and sad.")["input_ids"]
    pad = tokenizer.pad_token_id
    plain = rows_to_batch([{"input_ids": query + response,
                               "action_mask": [0] * len(query) + [1] * len(response)}], pad)
    padded = rows_to_batch([{"input_ids": [pad] * 3 + query + response,
                                "attention_mask": [0] * 3 + [1] * (len(query) + len(response)),
                                "action_mask": [0] * (3 + len(query)) + [1] * len(response)}], pad)
    assert padded["position_ids"][0, 3:].tolist() == list(range(len(query) + len(response)))
    lp_plain, lp_padded = token_logprobs(policy, plain), token_logprobs(policy, padded)
    actions_plain, actions_padded = plain["action_mask"].bool(), padded["action_mask"].bool()
    torch.testing.assert_close(lp_padded[actions_padded], lp_plain[actions_plain], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(lp_padded).all()


def test_value_head_starts_at_zero_and_learns(tiny_model_dir, tokenizer, tmp_path):
    critic = ValueModel.from_pretrained(tiny_model_dir)
    batch = _batch(tokenizer, ["he laughed, and the children laughed", "a terrible storm"])
    values = token_values(critic, batch)
    assert values.shape == batch["input_ids"].shape
    assert torch.all(values == 0)
    (values - 1.0).pow(2).mul(batch["action_mask"]).sum().backward()
    assert critic.head.weight.grad.abs().sum() > 0 and critic.head.bias.grad.abs().sum() > 0

    with torch.no_grad():
        critic.head.bias.fill_(0.5)
    critic.save_pretrained(tmp_path)
    reloaded = ValueModel.from_pretrained(str(tmp_path))
    torch.testing.assert_close(token_values(reloaded, batch), token_values(critic, batch))


def test_token_values_are_shifted_by_one(tiny_model_dir, tokenizer):
    critic = ValueModel.from_pretrained(tiny_model_dir)
    torch.nn.init.normal_(critic.head.weight)
    batch = _batch(tokenizer, ["we found a wonderful little house"])
    per_position = critic(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")})
    values = token_values(critic, batch)
    torch.testing.assert_close(values[:, 1:], per_position[:, :-1])


def test_reward_head_init_std(tiny_model_dir, tokenizer):
    rm = init_reward_model(tiny_model_dir, pad_token_id=tokenizer.pad_token_id, seed=0)
    weight = rm.score.weight
    d_model = weight.shape[1]
    # 32 weights are too few for a tight estimate, so compare with a generous but discriminating band.
    expected = 1 / (d_model + 1) ** 0.5
    assert 0.6 * expected < weight.std().item() < 1.4 * expected
    assert rm.config.reward_gain == 1.0 and rm.config.reward_bias == 0.0


def test_reward_head_init_std_large_hidden(tmp_path, tokenizer):
    """With d_model=512 the sample std of the head pins the formula 1/sqrt(d+1) to ~3%."""
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=512, n_layer=1, n_head=2, n_positions=16)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    rm = init_reward_model(str(tmp_path), pad_token_id=tokenizer.pad_token_id, seed=1)
    std = rm.score.weight.std().item()
    assert abs(std - 1 / 513 ** 0.5) < 0.1 / 513 ** 0.5
    assert abs(std - 1 / 512) > 0.5 / 512  # not a different common init


def test_reward_reads_last_attended_token(tiny_model_dir, tokenizer):
    rm = init_reward_model(tiny_model_dir, pad_token_id=tokenizer.pad_token_id, seed=0)
    batch = _batch(tokenizer, ["the old man walked to the market and felt happy.", "she smiled at"])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    scores = raw_reward_scores(rm, inputs)
    assert scores.shape == (2,)

    last = batch["attention_mask"][1].sum().item() - 1
    assert last + 1 < batch["input_ids"].shape[1], "row 1 must be padded for this test"
    changed_pad = {**inputs, "input_ids": inputs["input_ids"].clone()}
    changed_pad["input_ids"][1, last + 1:] = 7
    torch.testing.assert_close(raw_reward_scores(rm, changed_pad), scores)

    changed_last = {**inputs, "input_ids": inputs["input_ids"].clone()}
    changed_last["input_ids"][1, last] = (changed_last["input_ids"][1, last] + 1) % len(tokenizer)
    new_scores = raw_reward_scores(rm, changed_last)
    assert new_scores[0] == scores[0] and new_scores[1] != scores[1]


def test_gain_bias_applied_and_saved(tiny_model_dir, tokenizer, tmp_path):
    rm = init_reward_model(tiny_model_dir, pad_token_id=tokenizer.pad_token_id, seed=0)
    batch = _batch(tokenizer, ["the dark room was cold", "we found a house"])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    raw = raw_reward_scores(rm, inputs)
    set_reward_gain_bias(rm, 2.5, -0.75)
    torch.testing.assert_close(reward_scores(rm, inputs), raw * 2.5 - 0.75)

    rm.save_pretrained(tmp_path)
    reloaded = load_reward_model(str(tmp_path))
    assert (reloaded.config.reward_gain, reloaded.config.reward_bias) == (2.5, -0.75)
    torch.testing.assert_close(reward_scores(reloaded, inputs), raw * 2.5 - 0.75)


def test_plain_hf_sequence_classifier_loads(tmp_path, tokenizer):
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=32,
                        num_labels=1, pad_token_id=tokenizer.pad_token_id)
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    rm = load_reward_model(str(tmp_path))
    assert isinstance(rm, GPT2ForSequenceClassification)
    batch = _batch(tokenizer, ["she smiled", "a terrible storm broke"])
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    torch.testing.assert_close(reward_scores(rm, inputs), raw_reward_scores(rm, inputs))


def test_reward_model_with_several_labels_is_rejected(tmp_path, tokenizer):
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, num_labels=3)
    GPT2ForSequenceClassification(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="num_labels=3"):
        load_reward_model(str(tmp_path))


def test_dropout_is_off_in_train_mode(tmp_path, tokenizer):
    config = GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=2, n_positions=32,
                        resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    batch = _batch(tokenizer, ["the old man walked to the market", "she smiled"])
    for model in (load_causal_lm(str(tmp_path)), ValueModel.from_pretrained(str(tmp_path)),
                  init_reward_model(str(tmp_path), pad_token_id=tokenizer.pad_token_id)):
        model.train()
        assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    policy = load_causal_lm(str(tmp_path)).train()
    torch.testing.assert_close(token_logprobs(policy, batch), token_logprobs(policy, batch), rtol=0, atol=0)


def test_tokenizer_without_pad_gets_distinct_pad(tmp_path, tokenizer):
    tokenizer.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    no_pad = AutoTokenizer.from_pretrained(tmp_path)
    no_pad.pad_token = None
    no_pad.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == "[PAD]" and loaded.pad_token_id != loaded.eos_token_id


def test_a_pad_id_outside_the_vocabulary_never_reaches_the_model(tiny_model_dir):
    # GPT-2 has no pad token: load_tokenizer adds [PAD] with id == vocab size, and the model is not resized.
    model = load_causal_lm(tiny_model_dir)
    vocab = model.get_input_embeddings().num_embeddings
    rows = [{"input_ids": [5, 6, 7, 8], "action_mask": [0, 1, 1, 1]}, {"input_ids": [9, 10], "action_mask": [0, 1]}]
    out_of_vocab = token_logprobs(model, rows_to_batch(rows, pad_token_id=vocab), temperature=0.7)
    in_vocab = token_logprobs(model, rows_to_batch(rows, pad_token_id=3), temperature=0.7)
    mask = rows_to_batch(rows, pad_token_id=3)["attention_mask"].bool()
    torch.testing.assert_close(out_of_vocab[mask], in_vocab[mask])
    assert model.get_input_embeddings().num_embeddings == vocab


def test_rows_to_batch_pads_right_and_counts_positions():
    rows = [
        {"input_ids": [5, 6, 7, 8], "action_mask": [0, 0, 1, 1], "advantages": [0.0, 0.0, 0.5, -0.5]},
        {"input_ids": [9, 10], "action_mask": [0, 1], "advantages": [0.0, 2.0]},
    ]
    batch = rows_to_batch(rows, pad_token_id=99)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 99, 99]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 2]]
    assert batch["action_mask"].tolist() == [[0, 0, 1, 1], [0, 1, 0, 0]]
    assert batch["advantages"].dtype == torch.float32
    assert batch["advantages"].tolist() == [[0.0, 0.0, 0.5, -0.5], [0.0, 2.0, 0.0, 0.0]]
    assert padding_fraction(batch) == pytest.approx(2 / 8)


def test_rows_to_batch_rejects_bad_rows():
    with pytest.raises(ValueError, match="no rows"):
        rows_to_batch([], 0)
    with pytest.raises(ValueError, match="len\\(input_ids\\)"):
        rows_to_batch([{"input_ids": [1, 2], "action_mask": [1]}], 0)
    with pytest.raises(ValueError, match="same keys"):
        rows_to_batch([{"input_ids": [1], "action_mask": [1]},
                          {"input_ids": [1], "action_mask": [1], "returns": [0.0]}], 0)


def test_temperature_must_be_positive(policy, tokenizer):
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(policy, _batch(tokenizer, ["she smiled"], n_actions=1), temperature=0.0)


def test_logprobs_and_entropy_from_logits():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, 11, generator=generator)
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), expected)
    torch.testing.assert_close(logprobs_from_logits(logits.bfloat16(), labels), expected, atol=0.05, rtol=0)
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(probs * probs.log()).sum(-1))
    assert entropy_from_logits(torch.zeros(1, 4)).item() == pytest.approx(math.log(4))


@pytest.mark.parametrize("entropy, entropy_grad", [(False, False), (True, False), (True, True)])
def test_hand_written_head_gradient_equals_autograd(entropy, entropy_grad):
    """`_LabelLogprobs`' closed-form backward against autograd through log_softmax, in float64: the same
    values and the same logits gradient for a loss mixing both outputs (the entropy's only when it has one)."""
    from workers.forward import _LabelLogprobs
    generator = torch.Generator().manual_seed(3)
    logits = (torch.randn(7, 13, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    labels = torch.randint(0, 13, (7,), generator=generator)
    weights = torch.randn(2, 7, generator=generator, dtype=torch.float64)

    def loss(logprobs, ent):
        return (weights[0] * logprobs).sum() + ((weights[1] * ent).sum() if entropy_grad else 0)

    logprobs, ent = _LabelLogprobs.apply(logits, labels, entropy, entropy_grad)
    loss(logprobs, ent).backward()
    mine, logits.grad = logits.grad, None
    reference = torch.log_softmax(logits, -1)
    ref_logprobs = reference.gather(-1, labels[:, None]).squeeze(-1)
    ref_entropy = -(reference.exp() * reference).sum(-1)
    loss(ref_logprobs, ref_entropy).backward()
    torch.testing.assert_close(logprobs, ref_logprobs)
    if entropy:
        torch.testing.assert_close(ent, ref_entropy)
    assert ent.requires_grad == entropy_grad
    torch.testing.assert_close(mine, logits.grad)
