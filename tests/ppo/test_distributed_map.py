"""Scoring's gather: 2 gloo ranks each compute their balanced share of rows; every rank gets every row.

Rows of different lengths, some with a left-padded query (attention_mask 0 inside the row): each
row's per-token output must come back whole (one value per token of the row) and in row order,
on both ranks, with no pickling of results.
"""

import datetime
import types

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_core.ppo.trainer import PPOTrainer
from workers.procs import free_port

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


def scorer(rank: int, layout: str) -> PPOTrainer:
    """The trainer's map without models: only what `_distributed_map` reads."""
    trainer = object.__new__(PPOTrainer)
    algorithm = types.SimpleNamespace(max_tokens_per_device=24, packing=layout != "padded", share_prompts=layout == "shared")
    trainer.cfg = types.SimpleNamespace(algorithm=algorithm)
    trainer.layout = None if layout == "padded" else "rows"
    trainer.tokenizer = types.SimpleNamespace(pad_token_id=0)
    trainer.device, trainer.rank, trainer.world_size = torch.device("cpu"), rank, WORLD_SIZE
    return trainer


def worker(rank: int, port: int, out_dir: str, layout: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE,
                           timeout=datetime.timedelta(seconds=60))
    try:
        trainer = scorer(rank, layout)
        mine = [i for indices, real in trainer._micro_batches(rows()) if real for i in indices]
        torch.save({"outputs": trainer._distributed_map(rows(), per_token_and_per_row), "mine": mine},
                   f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", ["padded", "packed", "shared"])  # packed micro-batches still hand `fn` the padded rows
def test_every_rank_gets_every_rows_outputs(tmp_path, layout):
    mp.spawn(worker, args=(free_port(), str(tmp_path), layout), nprocs=WORLD_SIZE, join=True)
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
