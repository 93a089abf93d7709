"""rl_core.distributed's pieces, alone and on gloo ranks."""

import time

from rl_core.distributed import DataParallel


def test_each_rank_shares_items_once_and_pads_to_the_same_count():
    items = list("abcdefg")  # 7 over 3 ranks: 3, 3, 1
    shares = [DataParallel(rank=r, size=3).share(items) for r in range(3)]
    assert [mine for mine, _ in shares] == [list("abc"), list("def"), ["g"]]
    assert [padded for _, padded in shares] == [list("abc"), list("def"), ["g", "a", "a"]]
    # Every item once over the ranks; every rank the same count of padded items (its collectives line up).
    assert sorted(x for mine, _ in shares for x in mine) == items
    assert {len(padded) for _, padded in shares} == {3}
    # More ranks than items: the last ones hold only repeats, which count for nothing.
    assert DataParallel(rank=2, size=3).share(["x", "y"]) == ([], ["x"])
    assert DataParallel().share(items) == (items, items)


def _concat_on_rank(rank: int) -> None:
    dp = DataParallel(rank=rank, size=2, sharded=True)
    mine = [{"rank": rank, "row": i} for i in range(rank + 1)]  # unequal lengths: 1 row, then 2
    everyone = dp.concat(mine)
    assert everyone == [{"rank": 0, "row": 0}, {"rank": 1, "row": 0}, {"rank": 1, "row": 1}], everyone


def test_concat_gives_every_rank_every_ranks_items_in_rank_order(tmp_path):
    from tests.ranks import run_ranks

    run_ranks(_concat_on_rank, 2, tmp_path)


# Rank 0's part outlasts the collective timeout by half: without the untimed wait, rank 1's broadcast ends in
# gloo's "Timed out waiting 2000ms".
TIMEOUT_S, RANK0_WORK_S = 2.0, 3.0


def _rank0_work_longer_than_the_timeout(rank: int) -> None:
    import torch.distributed as dist

    from rl_core.distributed import broadcast_object, on_rank0, wait_for_rank0
    from rl_core.errors import PeerFailed

    def slow(result):
        time.sleep(RANK0_WORK_S)
        return result() if callable(result) else result

    assert on_rank0(lambda: slow("read"), "read the data") == ("read" if rank == 0 else None)
    # A failure after the wait reaches every rank, as the one from a quick part does.
    try:
        on_rank0(lambda: slow(lambda: 1 / 0), "fail slowly")
        raise AssertionError("on_rank0 returned")
    except ZeroDivisionError:
        assert rank == 0
    except PeerFailed as err:
        assert rank == 1 and "rank 0 failed: ZeroDivisionError" in str(err), err
    # The bare wait before a broadcast of what rank 0 alone computed (a rollout).
    batch = slow(["trajectory"]) if rank == 0 else None
    wait_for_rank0("rollout for version 1")
    assert broadcast_object(batch) == ["trajectory"]
    dist.barrier()  # timed again: both ranks are here


def test_rank0_alone_may_work_longer_than_the_collective_timeout(tmp_path):
    from tests.ranks import run_ranks

    run_ranks(_rank0_work_longer_than_the_timeout, 2, tmp_path, collective_timeout_s=TIMEOUT_S)
