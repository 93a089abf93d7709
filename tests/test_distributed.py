"""rl_core.distributed's pieces that need no process group."""

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
