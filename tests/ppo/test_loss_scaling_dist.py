"""Loss scaling with unequal per-rank batches: 2 gloo ranks, FSDP2 ``fully_shard`` on CPU.

Rank 0 holds 3 sequences and rank 1 holds 5, each split into 2 micro-batches (gradient
accumulation). For every ``loss_agg`` mode, summing per rank, dividing by the global count and
multiplying by ``dp_size`` must reproduce the single-process gradient of the whole batch,
while the naive per-rank mean must not. TFAdam is then stepped on the DTensor parameters.
"""

import warnings

import pytest
import torch
import torch.distributed as dist

from rl_core.ppo.algorithms import LOSS_AGG_MODES, global_denominator, loss_sum
from workers.worker import scale_loss
from rl_core.optim import TFAdam
from workers.forward import logprobs_from_logits
from tests.ranks import run_ranks

VOCAB, WIDTH, WORLD_SIZE = 13, 6, 2
SEQ_LENGTHS = [4, 9, 6, 3, 7, 5, 10, 8]
PROMPT_LENGTH = 2  # first tokens of every sequence are prompt (not actions)
MICRO_BATCHES = {0: [[0], [1, 2]], 1: [[3, 4], [5, 6, 7]]}  # unequal: 3 vs 5 sequences
LR = 0.01


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(tokens)))


def build_model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM().double()


def sequences() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(1, VOCAB, (length,), generator=generator) for length in SEQ_LENGTHS]


def padded(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, next-token labels and action mask for a right-padded micro-batch."""
    chosen = [sequences()[i] for i in indices]
    width = max(len(s) for s in chosen) - 1
    inputs = torch.zeros(len(chosen), width, dtype=torch.long)
    labels = torch.zeros_like(inputs)
    mask = torch.zeros_like(inputs, dtype=torch.bool)
    for row, seq in enumerate(chosen):
        inputs[row, : len(seq) - 1] = seq[:-1]
        labels[row, : len(seq) - 1] = seq[1:]
        mask[row, PROMPT_LENGTH - 1 : len(seq) - 1] = True
    return inputs, labels, mask


def per_token_loss(model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return -logprobs_from_logits(model(inputs), labels)


def accumulate(model, micro_batches, loss_agg, dp_size, denominator=None):
    """Backward over micro-batches with the loss-scaling rule; ``denominator=None`` -> naive local mean."""
    for indices in micro_batches:
        inputs, labels, mask = padded(indices)
        loss = per_token_loss(model, inputs, labels)
        if denominator is None:
            local_count = sum(global_denominator(padded(mb)[2], loss_agg) for mb in micro_batches)
            scale_loss(loss_sum(loss, mask, loss_agg), local_count, fsdp_ranks=1).backward()
        else:
            scale_loss(loss_sum(loss, mask, loss_agg), denominator, dp_size).backward()


def full_grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}


def worker(rank: int, out_dir: str) -> None:
    from torch.distributed.fsdp import fully_shard

    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
    model = build_model()
    fully_shard(model)
    mine = MICRO_BATCHES[rank]
    results = {}
    for loss_agg in LOSS_AGG_MODES:
        denominator = sum(global_denominator(padded(mb)[2], loss_agg) for mb in mine)
        dist.all_reduce(denominator, op=dist.ReduceOp.SUM)
        model.zero_grad(set_to_none=True)
        accumulate(model, mine, loss_agg, WORLD_SIZE, denominator)
        results[loss_agg] = full_grads(model)
        model.zero_grad(set_to_none=True)
        accumulate(model, mine, loss_agg, WORLD_SIZE, denominator=None)
        results[f"naive/{loss_agg}"] = full_grads(model)
    # One TFAdam step on the DTensor shards, from the token-mean gradient.
    model.zero_grad(set_to_none=True)
    denominator = sum(global_denominator(padded(mb)[2], "token-mean") for mb in mine)
    dist.all_reduce(denominator, op=dist.ReduceOp.SUM)
    accumulate(model, mine, "token-mean", WORLD_SIZE, denominator)
    TFAdam(model.parameters(), lr=LR, eps=1e-5).step()
    results["params_after_step"] = {name: p.detach().full_tensor().clone() for name, p in model.named_parameters()}
    torch.save(results, f"{out_dir}/rank{rank}.pt")


def single_process_grads(loss_agg: str) -> dict[str, torch.Tensor]:
    model = build_model()
    everything = list(range(len(SEQ_LENGTHS)))
    inputs, labels, mask = padded(everything)
    loss = scale_loss(loss_sum(per_token_loss(model, inputs, labels), mask, loss_agg), global_denominator(mask, loss_agg), 1)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def max_difference(a: dict, b: dict) -> float:
    return max((a[name] - b[name]).abs().max().item() for name in a)


@pytest.fixture(scope="module")
def distributed_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("loss_scaling")
    run_ranks(worker, WORLD_SIZE, out_dir, args=(str(out_dir),))
    return [torch.load(out_dir / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loss_agg", LOSS_AGG_MODES)
def test_scaled_loss_matches_single_process_gradient(distributed_results, loss_agg):
    reference = single_process_grads(loss_agg)
    for rank_results in distributed_results:
        assert max_difference(rank_results[loss_agg], reference) < 1e-5
        # The naive per-rank mean weights rank 0's 3 sequences like rank 1's 5: a different gradient.
        assert max_difference(rank_results[f"naive/{loss_agg}"], reference) > 1e-3


@pytest.mark.timeout(120)
def test_tf_adam_steps_dtensor_parameters_like_a_single_process(distributed_results):
    model = build_model()
    for name, param in model.named_parameters():
        param.grad = single_process_grads("token-mean")[name]
    TFAdam(model.parameters(), lr=LR, eps=1e-5).step()
    expected = {name: p.detach() for name, p in model.named_parameters()}
    initial = {name: p.detach() for name, p in build_model().named_parameters()}
    for rank_results in distributed_results:
        assert max_difference(rank_results["params_after_step"], expected) < 1e-8
        assert max_difference(rank_results["params_after_step"], initial) > 1e-3
