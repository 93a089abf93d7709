"""The one batch worker: 2 gloo ranks each compute their balanced share of rows, and every rank gets
every row (`BatchWorker.gather`, PPO's scoring).

Rows of different lengths, some with a left-padded query (attention_mask 0 inside the row): each
row's per-token output must come back whole (one value per token of the row) and in row order,
on both ranks, with no pickling of results.
"""

import pytest
import torch

from workers.layout import rows_to_batch
from tests.ranks import run_ranks
from workers.worker import BatchWorker, shared_prompt_units

WORLD_SIZE = 2
LENGTHS = [5, 12, 3, 9, 7, 7, 2, 11, 4]


def rows() -> list[dict]:
    out = []
    for i, n in enumerate(LENGTHS):
        pads = 2 if i % 3 == 0 else 0  # a left-padded query: attention_mask 0 on its first tokens
        out.append({"input_ids": [100 * i + t for t in range(n)], "action_mask": [0] * 2 + [1] * (n - 2),
                    "attention_mask": [0] * pads + [1] * (n - pads)})
    out[5]["input_ids"][:2] = out[4]["input_ids"][:2]  # two responses to one prompt (shared when asked)
    return out


def per_token_and_per_row(batch):
    """A per-token output that names its token, and a per-row one; rank-independent."""
    ids = batch["input_ids"].float()
    return ids * batch["attention_mask"], ids[:, 0]


def batch() -> dict[str, torch.Tensor]:
    return rows_to_batch(rows(), pad_token_id=0)


def make_worker(rank: int, layout: str) -> BatchWorker:
    return BatchWorker(rank, WORLD_SIZE, torch.device("cpu"), max_tokens=24,
                       layout=None if layout == "padded" else "rows", share_prompts=layout == "shared")


def worker(rank: int, out_dir: str, layout: str) -> None:
    worker = make_worker(rank, layout)
    mine = [i for indices, real in worker.plan(batch()) if real for i in indices]
    torch.save({"outputs": worker.compute_and_share(batch(), per_token_and_per_row), "mine": mine},
               f"{out_dir}/rank{rank}.pt")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])  # packed micro-batches still hand `fn` the padded rows
def test_every_rank_gets_every_rows_outputs(tmp_path, layout):
    run_ranks(worker, WORLD_SIZE, tmp_path, args=(str(tmp_path), layout))
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]
    assert all(r["mine"] for r in results) and sorted(results[0]["mine"] + results[1]["mine"]) == list(range(len(LENGTHS)))
    for result in results:
        per_token, per_row = result["outputs"]
        assert per_token.shape == (len(LENGTHS), max(LENGTHS)) and per_row.shape == (len(LENGTHS),)
        for i, row in enumerate(rows()):
            n = len(row["input_ids"])
            expected = torch.tensor(row["input_ids"], dtype=torch.float32) * torch.tensor(row["attention_mask"])
            assert torch.equal(per_token[i, :n], expected)  # whole row, padded query included
            assert per_row[i] == row["input_ids"][0]


def test_rows_that_stay_together_share_a_micro_batch_and_every_rank_runs_as_many():
    units = [[0, 1], [2, 3], [4], [5, 6], [7], [8]]  # e.g. DPO pairs, reward-model comparisons
    plans = [make_worker(rank, "padded").plan(batch(), units) for rank in range(WORLD_SIZE)]
    assert len(plans[0]) == len(plans[1])
    placed = [indices for plan in plans for indices, real in plan if real]
    assert sorted(i for indices in placed for i in indices) == list(range(len(LENGTHS)))
    for unit in units:
        assert any(set(unit) <= set(indices) for indices in placed), unit


def test_a_unit_longer_than_a_micro_batch_is_one_line_naming_the_key():
    with pytest.raises(ValueError, match="max_tokens_per_device=24"):
        make_worker(0, "padded").plan(batch(), [list(range(len(LENGTHS)))])


@pytest.mark.timeout(120)
def test_a_micro_batch_is_its_rows_selected_and_trimmed_not_recollated():
    worker = make_worker(0, "padded")
    whole = batch()
    for indices, real in worker.plan(whole):
        micro = worker.micro_batch(whole, indices)
        expected = rows_to_batch([rows()[i] for i in indices], pad_token_id=0)
        assert set(expected) <= set(micro)
        for key, value in expected.items():
            assert torch.equal(micro[key], value), key


def test_rows_with_one_prompt_are_balanced_as_one_unit_within_the_budget():
    def row(prompt, response, pads=0):
        return {"input_ids": [0] * pads + prompt + response, "attention_mask": [0] * pads + [1] * (len(prompt) + len(response)),
                "action_mask": [0] * (pads + len(prompt)) + [1] * len(response)}

    rows = [row([5, 6, 7], [8, 9]), row([1, 2], [3]), row([5, 6, 7], [4], pads=2), row([5, 6, 7], [9, 9, 9]),
            {"input_ids": [4, 4], "attention_mask": [1, 1], "action_mask": [0, 0]}]  # no actions (a reward-model row)

    def prompt_units(rows, max_tokens):
        return list(zip(*shared_prompt_units(rows_to_batch(rows, pad_token_id=0), None, max_tokens)))

    units = sorted(prompt_units(rows, max_tokens=100))
    assert units == [([0, 2, 3], 3 + 2 + 1 + 3), ([1], 3), ([4], 2)]
    # a group over the budget is cut into chunks that each fit, every chunk with its own copy of the prompt
    assert sorted(prompt_units(rows, max_tokens=7)) == [([0, 2], 3 + 2 + 1), ([1], 3), ([3], 3 + 3), ([4], 2)]
