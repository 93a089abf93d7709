"""FSDP2 on 2 gloo ranks: full weights, loss-scaled gradient equivalence, dcp checkpoint round trip.

One spawn runs every distributed scenario and saves what each rank saw; the tests compare it with
a single-process reference computed here.
"""

import os

import pytest
import torch
from torch.overrides import TorchFunctionMode

from rl_core.optim import build_optimizer
from tests.ranks import run_ranks
from workers.read_back import read_back

WORLD_SIZE = 2
LR = 1e-2
MAX_GRAD_NORM = 0.05  # small enough that clipping is active, so the clip is tested too
# Uneven split on purpose (3 rows vs 2): balancing gives ranks different counts.
RANK_MICRO_BATCH_ROWS = {0: [[0, 1], [2]], 1: [[3], [4]]}


def _rows(tokenizer) -> list[dict]:
    texts = ["the old man walked to the market", "she smiled at the bright", "the dark room was cold and sad",
             "he laughed", "a terrible storm broke the quiet night"]
    rows = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        rows.append({"input_ids": ids, "action_mask": [0] * 2 + [1] * (len(ids) - 2)})
    return rows


def _accumulate(trainable, micro_batches, loss_fn, world_size: int = 1) -> dict[str, list]:
    """A job's micro-batch loop (`BatchWorker.forward_backward` without the balancing): the count check, then
    `loss_fn`'s already-scaled loss backward per micro-batch; each metric a list, tensors unread."""
    from workers.worker import check_same_count_on_all_ranks

    check_same_count_on_all_ranks(len(micro_batches), world_size, torch.device("cpu"))
    trainable.model.train()
    metrics: dict[str, list] = {}
    for micro_batch in micro_batches:
        loss, micro_metrics = loss_fn(trainable.model, micro_batch)
        loss.backward()
        for key, value in {"loss": loss, **micro_metrics}.items():
            metrics.setdefault(key, []).append(value.detach() if isinstance(value, torch.Tensor) else value)
    return metrics


def _loss_fn(global_tokens: int, dp_size: int):
    """Token-mean NLL scaled per the rule: sum on this rank / global count * dp_size."""
    from workers.forward import token_logprobs

    def loss_fn(model, batch):
        logprobs = token_logprobs(model, batch, temperature=0.9)
        loss = -(logprobs * batch["action_mask"]).sum() / global_tokens * dp_size
        return loss, {"tokens": batch["action_mask"].sum()}

    return loss_fn


def _build_trainable(model):
    from workers.trainable import TrainableModel

    return TrainableModel(
        model,
        build_optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1),
        build_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - 0.1 * step),
        max_grad_norm=MAX_GRAD_NORM,
    )


def _micro_batches(tokenizer, groups):
    from workers.layout import rows_to_batch

    rows = _rows(tokenizer)
    return [rows_to_batch([rows[i] for i in group], tokenizer.pad_token_id) for group in groups]


def _global_tokens(tokenizer) -> int:
    return sum(sum(row["action_mask"]) for row in _rows(tokenizer))


def _scorer_outputs(tokenizer, model_dir: str, shard: bool) -> dict:
    """Critic values and reward scores on all rows; sharded or not, they must agree."""
    from workers.fsdp import shard_model
    from workers.forward import raw_reward_scores, token_values
    from workers.loading import ValueModel, init_reward_model

    critic = ValueModel.from_pretrained(model_dir)
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(3))
    reward_model = init_reward_model(model_dir, pad_token_id=tokenizer.pad_token_id, seed=0)
    if shard:
        critic, reward_model = shard_model(critic), shard_model(reward_model)
    (batch,) = _micro_batches(tokenizer, [[0, 1, 2, 3, 4]])
    inputs = {key: batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        return {"values": token_values(critic, batch), "rewards": raw_reward_scores(reward_model, inputs)}


def _worker(rank: int, model_dir: str, out_dir: str) -> None:
    from workers.fsdp import full_state_dict, shard_model
    from workers.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    results = {}
    model = shard_model(load_causal_lm(model_dir))
    results["original"] = full_state_dict(model)

    trainable = _build_trainable(model)
    micro_batches = _micro_batches(tokenizer, RANK_MICRO_BATCH_ROWS[rank])
    loss_fn = _loss_fn(_global_tokens(tokenizer), WORLD_SIZE)
    results["metrics"] = read_back(_accumulate(trainable, micro_batches, loss_fn, WORLD_SIZE))
    results["grad_norm"] = trainable.step().item()
    results["trained"] = full_state_dict(model)

    checkpoint_dir = os.path.join(out_dir, "checkpoint")
    trainable.save_checkpoint(checkpoint_dir)
    restored = _build_trainable(shard_model(load_causal_lm(model_dir)))
    restored.load_checkpoint(checkpoint_dir)
    results["restored"] = full_state_dict(restored.model)
    results["lr"] = (trainable.current_lr(), restored.current_lr())
    # A second identical step on both proves the optimizer moments and step count came back too.
    for each in (trainable, restored):
        _accumulate(each, micro_batches, loss_fn, WORLD_SIZE)
        each.step()
    results["second_step"] = (full_state_dict(trainable.model), full_state_dict(restored.model))

    results["scorers"] = _scorer_outputs(tokenizer, model_dir, shard=True)

    try:  # rank 1 brings one micro-batch fewer: every rank must refuse rather than hang
        _accumulate(trainable, micro_batches[: 2 - rank], loss_fn, WORLD_SIZE)
        results["mismatch_error"] = None
    except ValueError as error:
        results["mismatch_error"] = str(error)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def distributed_results(tiny_model_dir, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("fsdp"))
    run_ranks(_worker, WORLD_SIZE, out_dir, args=(tiny_model_dir, out_dir))
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def single_process_step(tiny_model_dir):
    """The reference: one process, all rows, dp_size 1."""
    from workers.loading import load_causal_lm, load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    trainable = _build_trainable(load_causal_lm(tiny_model_dir))
    micro_batches = _micro_batches(tokenizer, [[0, 1, 2, 3, 4]])
    _accumulate(trainable, micro_batches, _loss_fn(_global_tokens(tokenizer), dp_size=1))
    grad_norm = trainable.step().item()
    return {name: p.detach().clone() for name, p in trainable.model.state_dict().items()}, grad_norm


def _assert_state_dicts_close(actual, expected, atol=1e-6):
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.timeout(180)
def test_full_state_dict_on_every_rank_equals_unsharded(distributed_results, tiny_model_dir):
    from workers.loading import load_causal_lm

    unsharded = load_causal_lm(tiny_model_dir).state_dict()
    for results in distributed_results:
        assert all(t.device.type == "cpu" for t in results["original"].values())
        _assert_state_dicts_close(results["original"], unsharded, atol=0)


@pytest.mark.timeout(180)
def test_two_rank_step_matches_single_process(distributed_results, single_process_step):
    expected_weights, expected_grad_norm = single_process_step
    for results in distributed_results:
        assert results["grad_norm"] == pytest.approx(expected_grad_norm, rel=1e-5)
        assert results["grad_norm"] > MAX_GRAD_NORM, "clipping must be active for this test to cover it"
        _assert_state_dicts_close(results["trained"], expected_weights, atol=1e-5)
        assert not torch.equal(results["trained"]["transformer.h.0.attn.c_attn.weight"],
                               results["original"]["transformer.h.0.attn.c_attn.weight"])
    tokens = [sum(r["metrics"]["tokens"]) for r in distributed_results]
    assert tokens[0] != tokens[1]  # ranks really held different amounts of data


@pytest.mark.timeout(180)
def test_dcp_checkpoint_round_trip(distributed_results):
    for results in distributed_results:
        _assert_state_dicts_close(results["restored"], results["trained"], atol=0)
        assert results["lr"][0] == results["lr"][1] == pytest.approx(LR * 0.9)
        after_original, after_restored = results["second_step"]
        _assert_state_dicts_close(after_restored, after_original, atol=0)


@pytest.mark.timeout(180)
def test_sharded_critic_and_reward_model_match_unsharded(distributed_results, tiny_model_dir):
    from workers.loading import load_tokenizer

    expected = _scorer_outputs(load_tokenizer(tiny_model_dir), tiny_model_dir, shard=False)
    assert expected["values"].abs().sum() > 0
    for results in distributed_results:
        torch.testing.assert_close(results["scorers"]["values"], expected["values"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(results["scorers"]["rewards"], expected["rewards"], atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(180)
def test_mismatched_micro_batch_counts_are_refused_on_every_rank(distributed_results):
    for results in distributed_results:
        assert results["mismatch_error"] is not None and "micro-batches" in results["mismatch_error"]


@pytest.mark.timeout(180)
def test_single_process_without_torchrun(tiny_model_dir, monkeypatch):
    """A plain `python` run gets a one-rank group, so the sharded code path is the same."""
    import torch.distributed as dist

    from rl_core.distributed import init_distributed, rank_seed
    from workers.fsdp import full_state_dict, shard_model
    from workers.loading import load_causal_lm

    keys = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    for key in keys:
        monkeypatch.delenv(key, raising=False)
    assert rank_seed(1, 0) == 1 and rank_seed(1, 2) == 1 + 2 * 100003
    assert init_distributed(timeout_s=30) == (0, 1)
    for key in keys:  # set by init_distributed: undone when the test ends, like the deletions above
        monkeypatch.setenv(key, os.environ[key])
    try:
        unsharded = load_causal_lm(tiny_model_dir).state_dict()
        model = shard_model(load_causal_lm(tiny_model_dir))
        _assert_state_dicts_close(full_state_dict(model), unsharded, atol=0)
    finally:
        dist.destroy_process_group()


HOST_READS = {"item", "tolist", "__bool__", "__float__", "__int__", "nonzero", "cpu", "numpy"}


class CountHostReads(TorchFunctionMode):
    """Every call that reads a tensor back to the host."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_an_optimizer_step_reads_nothing_and_its_metrics_come_back_in_one_transfer():
    """On a GPU every read of a device tensor stalls the host: the metrics of all micro-batches and the grad
    norm stay on the device through forward, backward and the optimizer step, and come back at once."""
    from workers.trainable import TrainableModel

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    trainable = TrainableModel(model, lambda m: build_optimizer(m.parameters(), "adam", lr=0.1))
    micro_batches = [{"x": torch.randn(3, 4)} for _ in range(4)]

    def loss_fn(m, batch):
        out = m(batch["x"])
        return out.pow(2).sum(), {"mean": out.mean(), "max": out.max(), "rows": 3}

    with torch.no_grad():
        outs = [model(b["x"]) for b in micro_batches]
    with CountHostReads() as counter:
        metrics = _accumulate(trainable, micro_batches, loss_fn)
        metrics["grad_norm"] = [trainable.step()]
        assert counter.reads == []
        metrics = read_back(metrics)
    assert counter.reads == ["tolist"]  # 4 micro-batches x 3 tensors and the norm, one transfer
    assert metrics["loss"] == pytest.approx([o.pow(2).sum().item() for o in outs])
    assert metrics["max"] == pytest.approx([o.max().item() for o in outs]) and metrics["rows"] == [3.0] * 4
    assert metrics["grad_norm"][0] > 0


@pytest.mark.parametrize("optimizer", ["adam", "adamw", "tf_adam", "sgd"])
def test_a_non_finite_gradient_skips_the_update_decided_on_the_device(optimizer):
    """The skip of a non-finite step is the optimizer's `found_inf` (no host read) where it takes one; a plain
    SGD decides on the host. Either way the weights and the optimizer state stay as they were, and the next
    finite step trains as if the bad one had never happened."""
    from workers.trainable import TrainableModel

    def build(m):
        if optimizer == "sgd":
            return torch.optim.SGD(m.parameters(), lr=0.1)
        return build_optimizer(m.parameters(), optimizer, lr=0.1)

    def train(poison_first: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2)
        trainable = TrainableModel(model, build)
        x = torch.randn(3, 4)
        norms = []
        for poisoned in ([True, False] if poison_first else [False]):
            _accumulate(trainable, [{"x": x * (float("nan") if poisoned else 1.0)}],
                        lambda m, b: (m(b["x"]).pow(2).sum(), {}))
            norms.append(trainable.step())
        return [p.detach().clone() for p in model.parameters()], torch.stack(norms)

    clean, clean_norms = train(poison_first=False)
    after_skip, norms = train(poison_first=True)
    assert not torch.isfinite(norms[0]) and torch.isfinite(norms[1])
    assert norms[1] == pytest.approx(clean_norms[0].item())
    for expected, got in zip(clean, after_skip):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
