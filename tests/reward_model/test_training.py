"""Reward-model training pieces: balanced micro-batches of whole comparisons, normalisation samples."""

import pytest
import torch


def test_micro_batches_keep_comparisons_whole_and_ranks_even():
    from rl_core.preferences import TokenizedPreference
    from rl_core.reward_model.training import collate
    from workers.worker import BatchWorker

    examples = [TokenizedPreference([[5] * (3 + i % 7), [6] * (2 + i % 5)], 1, i % 2, 0.0) for i in range(13)]
    batch, units = collate(examples, pad_id=0)
    workers = [BatchWorker(rank, 2, torch.device("cpu"), max_tokens=40) for rank in (0, 1)]
    per_rank = [worker.micro_batches(batch, units) for worker in workers]
    assert len(per_rank[0]) == len(per_rank[1]), "every rank runs the same number of passes"
    real = [micro for batches in per_rank for micro, is_real in batches if is_real]
    assert sum(micro["input_ids"].shape[0] for micro in real) == 2 * len(examples), "each response once"
    for micro in real:  # a comparison's two responses side by side, carrying its best index
        assert torch.equal(micro["best"][0::2], micro["best"][1::2])
        assert int(micro["input_ids"].shape[0] * micro["input_ids"].shape[1]) <= 40
    best = sorted(b for micro in real for b in micro["best"][0::2].tolist())
    assert best == sorted(e.best for e in examples)


def test_normalisation_samples_are_cut_at_the_truncate_token_or_left_out(tiny_model_dir):
    from collections import Counter

    from rl_core.reward_model.config import NormalizeConfig
    from rl_core.reward_model.sampling import sample_responses, sample_truncated
    from rl_core.reward_model.training import _mark_invalid, _valid_only
    from workers.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    policy = load_causal_lm(tiny_model_dir).eval()
    queries = [tokenizer.encode("Tom was happy.")] * 24
    rng_before = torch.random.get_rng_state()
    plain = sample_responses(policy, tokenizer, queries, 12, 1.0, seed=3)
    assert torch.equal(torch.random.get_rng_state(), rng_before), "the caller's random stream is untouched"
    assert all(len(response) == 12 for response in plain), "EOS does not end a sample (OpenAI: fixed length)"
    assert len({tuple(response) for response in plain}) > 1, "sampled, not greedy"
    # The random test model has no favourite '.', so truncate at the token it samples most.
    counts = Counter(token for response in plain for token in response[1:])
    token = next(t for t, _ in counts.most_common()
                 if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t])
    cfg = NormalizeConfig(response_length=12, truncate_after=1, truncate_token=tokenizer.decode([token]))
    responses, valid = sample_truncated(policy, tokenizer, queries, cfg, seed=3)
    assert valid.any()
    for response, full, ok in zip(responses, plain, valid.tolist()):
        if ok:
            assert response == full[:len(response)] and response[-1] == token and token not in response[1:-1]
        else:
            assert response == full and token not in full[1:]
    scores = _mark_invalid(torch.arange(24.0), valid)
    assert torch.equal(_valid_only(scores, cfg), torch.arange(24.0)[valid])
    with pytest.raises(ValueError, match="normalize.truncate_token"):
        _valid_only(torch.full((4,), float("nan")), cfg)
