"""The shared rank launcher (tests/ranks.py): a rank that dies is named, with its own output."""

import os
import sys
import time

import pytest

from tests.ranks import run_ranks


def _rank_1_aborts(rank: int) -> None:
    import torch.distributed as dist

    if rank == 1:
        print("rank 1 is about to abort", file=sys.stderr, flush=True)
        os.abort()
    dist.barrier()  # rank 0 waits for a peer that never comes: the launcher must not wait for the timeout


def test_a_dead_rank_fails_the_test_with_its_signal_and_its_own_output(tmp_path):
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_ranks(_rank_1_aborts, 2, tmp_path, timeout_s=120)
    message = str(failure.value)
    assert "rank1: killed by SIGABRT" in message and "rank 1 is about to abort" in message
    assert "--- rank0: " in message  # the survivor is reported too, and was not waited for until the timeout
    assert time.monotonic() - start < 60
