"""Padding-free micro-batches (layout.pack): the model runs on the rows' real tokens back to back, and
every per-token quantity the jobs train on comes back to the padded rows equal to the padded path's."""

import pytest
import torch

from workers.forward import run_inputs, token_logprobs, token_logprobs_and_entropy, token_values
from workers.layout import rows_to_batch, model_inputs, pack, packs_into_one_row, padding_fraction
from workers.loading import ValueModel, load_causal_lm


def ppo_rows(seed: int = 0) -> list[dict]:
    """Rows as the PPO job builds them: a query left-padded inside the row (attention 0 there, OpenAI's
    fixed query length), a response of varying length, per-token training inputs."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for query, pads, response in ((4, 2, 9), (6, 0, 1), (3, 3, 14), (5, 1, 5), (2, 4, 3)):
        length = pads + query + response
        rows.append({"input_ids": [0] * pads + torch.randint(3, 250, (query + response,), generator=generator).tolist(),
                     "attention_mask": [0] * pads + [1] * (query + response),
                     "action_mask": [0] * (pads + query) + [1] * response,
                     "advantages": torch.randn(length, generator=generator).tolist()})
    return rows


def grouped_ppo_rows(seed: int = 0) -> list[dict]:
    """`ppo_rows` plus two GRPO-like groups: responses to one prompt, left-padded differently."""
    generator = torch.Generator().manual_seed(seed + 100)
    rows = ppo_rows(seed)
    for query, members in ((5, ((1, 7), (1, 2), (3, 11))), (3, ((0, 4), (2, 1)))):
        prompt = torch.randint(3, 250, (query,), generator=generator).tolist()
        for pads, response in members:
            length = pads + query + response
            rows.append({"input_ids": [0] * pads + prompt + torch.randint(3, 250, (response,), generator=generator).tolist(),
                         "attention_mask": [0] * pads + [1] * (query + response),
                         "action_mask": [0] * (pads + query) + [1] * response,
                         "advantages": torch.randn(length, generator=generator).tolist()})
    return rows


def test_shared_prompts_are_packed_once_per_group():
    batch = rows_to_batch(grouped_ppo_rows(), pad_token_id=0)
    plain, shared = pack(batch), pack(batch, share_prompts=True)
    # the two groups' prompts (5 tokens x 3 responses, 3 x 2) are held once each
    assert int((shared["packed_segment_ids"] >= 0).sum()) == int(batch["attention_mask"].sum()) - (5 * 2 + 3 * 1)
    assert int((plain["packed_segment_ids"] >= 0).sum()) == int(batch["attention_mask"].sum())
    index = shared["packed_index"]
    flat_ids = shared["packed_input_ids"].flatten()
    assert torch.equal(flat_ids[index[index >= 0]], batch["input_ids"][index >= 0])
    assert torch.equal(shared["packed_position_ids"].flatten()[index[index >= 0]], batch["position_ids"][index >= 0])
    # the group's rows point at the same prompt positions
    prompt = (batch["attention_mask"] == 1) & (batch["action_mask"] == 0)
    assert index[5][prompt[5]].tolist() == index[6][prompt[6]].tolist() == index[7][prompt[7]].tolist()
    assert index[8][prompt[8]].tolist() == index[9][prompt[9]].tolist() != index[5][prompt[5]][:3].tolist()


def test_pack_keeps_every_real_token_once_and_drops_the_padding():
    batch = rows_to_batch(ppo_rows(), pad_token_id=0)
    packed = pack(batch)
    real = int(batch["attention_mask"].sum())
    index = packed["packed_index"]
    assert sorted(index[index >= 0].tolist()) == sorted(set(index[index >= 0].tolist()))  # one place each
    assert int((index >= 0).sum()) == real == int((packed["packed_segment_ids"] >= 0).sum())
    flat_ids = packed["packed_input_ids"].flatten()
    assert torch.equal(flat_ids[index[index >= 0]], batch["input_ids"][index >= 0])
    assert packed["packed_input_ids"].numel() < batch["input_ids"].numel()
    assert padding_fraction(packed) < padding_fraction(batch)
    # positions restart at every sequence and equal the padded rows' (pads do not shift positions)
    assert torch.equal(packed["packed_position_ids"].flatten()[index[index >= 0]], batch["position_ids"][index >= 0])


def test_one_row_is_every_real_token_with_restarting_positions_and_no_mask():
    batch = rows_to_batch(ppo_rows(), pad_token_id=0)
    flat = pack(batch, one_row=True)
    real = int(batch["attention_mask"].sum())
    assert flat["packed_input_ids"].shape == (1, real) and padding_fraction(flat) == 0.0
    index = flat["packed_index"]
    assert torch.equal(flat["packed_input_ids"].flatten()[index[index >= 0]], batch["input_ids"][index >= 0])
    positions = flat["packed_position_ids"][0]
    assert int((positions == 0).sum()) == len(ppo_rows())  # where each sequence starts: flash's cu_seqlens
    inputs = model_inputs(flat)
    assert "attention_mask" not in inputs
    assert "attention_mask" in model_inputs(pack(batch))  # the rows layout keeps its block-diagonal mask
    with pytest.raises(ValueError, match="share_prompts or one_row"):
        pack(rows_to_batch(grouped_ppo_rows(), pad_token_id=0), share_prompts=True, one_row=True)
    assert packs_into_one_row("flash_attention_2") and packs_into_one_row("kernels-community/flash-attn3")
    assert not packs_into_one_row("sdpa") and not packs_into_one_row(None)


@pytest.mark.parametrize("layout", ["padded", "rows", "shared prompts"])
def test_the_trainers_forwards_build_no_kv_cache(tiny_model_dir, layout):
    """A config that says use_cache (GPT-2's does) made the trainer's every forward copy each layer's keys and
    values into a cache nothing reads; the inputs the trainer runs the model on turn it off."""
    policy = load_causal_lm(tiny_model_dir)
    policy.config.use_cache = True
    batch = rows_to_batch(grouped_ppo_rows(), pad_token_id=0)
    if layout != "padded":
        batch = pack(batch, share_prompts=layout == "shared prompts")
    with torch.no_grad():
        out = policy(**run_inputs(policy, batch))
        assert policy(**{**run_inputs(policy, batch), "use_cache": True}).past_key_values is not None
    assert out.past_key_values is None


# one_row runs through sdpa here: transformers builds the block-diagonal mask from the restarting position ids,
# the same boundaries its flash path hands the varlen kernel (checked on a GPU by scripts/gpu_check.sh).
@pytest.mark.parametrize("temperature, share_prompts, one_row",
                         [(1.0, False, False), (0.7, False, False), (1.0, True, False), (0.7, True, False),
                          (1.0, False, True), (0.7, False, True)])
def test_packed_logprobs_entropy_values_and_gradients_equal_the_padded_ones(tiny_model_dir, temperature, share_prompts,
                                                                            one_row):
    torch.manual_seed(0)
    policy = load_causal_lm(tiny_model_dir)
    critic = ValueModel.from_pretrained(tiny_model_dir, torch.float32)
    with torch.no_grad():
        critic.head.weight.normal_()  # OpenAI's zero-initialised head would hide a misplaced value
    padded = rows_to_batch(grouped_ppo_rows(), pad_token_id=0)
    results = []
    for batch in (padded, pack(padded, share_prompts=share_prompts, one_row=one_row)):
        policy.zero_grad()
        critic.zero_grad()
        mask = batch["action_mask"].float()
        logprobs, entropy = token_logprobs_and_entropy(policy, batch, temperature)
        values = token_values(critic, batch)
        loss = -(logprobs * batch["advantages"] * mask).sum() + ((values - 1.0) ** 2 * mask).sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in [*policy.named_parameters(), *critic.named_parameters()]}
        with torch.no_grad():
            alone = token_logprobs(policy, batch, temperature)
            actions = token_logprobs(policy, batch, temperature, actions_only=True)
        results.append(([t * mask for t in (logprobs, entropy, values, alone)] + [actions], loss.detach(), grads))
    (padded_out, padded_loss, padded_grads), (packed_out, packed_loss, packed_grads) = results
    names = ("logprobs", "entropy", "values", "token_logprobs", "actions_only")
    for name, a, b in zip(names, padded_out, packed_out):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5, msg=name)
    assert packed_loss.item() == pytest.approx(padded_loss.item(), rel=1e-5)
    for name, grad in padded_grads.items():
        # to 1e-5 of the tensor's scale: a different summation order moves the largest entries' last bits
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(),
                                   msg=lambda message: f"{name}: {message}")


@pytest.mark.parametrize("one_row", [False, True])
def test_packed_reward_scores_and_gradients_equal_the_padded_ones(tiny_model_dir, one_row):
    from workers.forward import raw_reward_scores
    from workers.loading import init_reward_model

    reward_model = init_reward_model(tiny_model_dir, pad_token_id=0, seed=0)
    padded = rows_to_batch([{k: r[k] for k in ("input_ids", "attention_mask", "action_mask")} for r in ppo_rows(1)],
                              pad_token_id=0)
    results = []
    for batch in (padded, pack(padded, one_row=one_row)):
        reward_model.zero_grad()
        scores = raw_reward_scores(reward_model, batch)
        (scores * torch.arange(1.0, len(scores) + 1)).sum().backward()  # each row's score with its own weight
        results.append((scores.detach(), {n: p.grad.clone() for n, p in reward_model.named_parameters()}))
    (padded_scores, padded_grads), (packed_scores, packed_grads) = results
    torch.testing.assert_close(packed_scores, padded_scores, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-5, atol=1e-5 * grad.abs().max().item(),
                                   msg=lambda message: f"{name}: {message}")


@pytest.mark.parametrize("share_prompts,one_row,multiple", [(False, False, 1), (True, False, 4), (False, True, 2)])
def test_every_token_of_a_large_random_batch_sees_exactly_its_own_earlier_tokens(share_prompts, one_row, multiple):
    """40 rows in groups (a prompt with 1-4 responses, left pads inside the row, rows with no action): through the
    packed layout's index and mask, each real token sees exactly the earlier real tokens of its own row."""
    from workers.layout import attention_masks

    generator = torch.Generator().manual_seed(1)
    rows = []
    while len(rows) < 40:
        prompt = torch.randint(3, 250, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator).tolist()
        for _ in range(int(torch.randint(1, 5, (1,), generator=generator))):
            pads, response = (int(v) for v in torch.randint(0, 4, (2,), generator=generator))
            tokens = prompt + torch.randint(3, 250, (response,), generator=generator).tolist()
            rows.append({"input_ids": [0] * pads + tokens, "attention_mask": [0] * pads + [1] * len(tokens),
                         "action_mask": [0] * (pads + len(prompt)) + [1] * response})
    batch = rows_to_batch(rows, pad_token_id=0)
    packed = pack(batch, share_prompts=share_prompts, one_row=one_row, multiple=multiple)
    assert packed["packed_input_ids"].shape[1] % multiple == 0 and (len(packed["packed_input_ids"]) == 1 or not one_row)
    index, real = packed["packed_index"], batch["attention_mask"].bool()
    assert torch.equal(index >= 0, real)
    assert torch.equal(packed["packed_input_ids"].flatten()[index[real]], batch["input_ids"][real])
    assert torch.equal(packed["packed_position_ids"].flatten()[index[real]], batch["position_ids"][real])
    sees = attention_masks(packed)[:, 0] if not one_row else None
    width = packed["packed_input_ids"].shape[1]
    for row in range(len(rows)):
        places = index[row][real[row]]
        assert len(set(places.tolist())) == len(places)
        if sees is None:  # one row: sequences are told apart by restarting positions
            continue
        packed_row, columns = places // width, places % width
        assert (packed_row == packed_row[0]).all()
        visible = sees[packed_row[0]][columns][:, columns]
        assert torch.equal(visible, torch.ones_like(visible).tril()), f"row {row}"
        # and nothing else that is real: the row's tokens see only these positions among all real ones
        others = torch.zeros(width, dtype=torch.bool)
        others[columns] = True
        assert not (sees[packed_row[0]][columns] & ~others & (packed["packed_segment_ids"][packed_row[0]] >= 0)).any()
    if share_prompts:  # each group's prompt is held once: fewer packed tokens than real ones
        assert int((packed["packed_segment_ids"] >= 0).sum()) < int(real.sum())
