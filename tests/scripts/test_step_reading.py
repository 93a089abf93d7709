"""scripts/step_reading.py's counting (the whole job run is the script's own 20 s; these check what it counts)."""

import sys
from pathlib import Path

import torch

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
step_reading = load_script("step_reading")


def test_a_call_into_another_project_file_is_one_crossing_and_a_call_within_a_file_none():
    from workers.worker import BatchWorker

    worker = BatchWorker(rank=0, world_size=1, device=torch.device("cpu"), max_tokens=64)
    batch = {"attention_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])}
    calls = step_reading.StepCalls()
    calls.recording = True
    sys.setprofile(calls.hook)
    try:
        plan = worker.plan(batch)  # worker.py -> balance.py twice; balance.py's own calls stay inside it
    finally:
        sys.setprofile(None)
    assert sorted(row for indices, _ in plan for row in indices) == [0, 1, 2]
    short = {(Path(a).name, fa, Path(b).name, fb) for a, fa, b, fb in calls.edges}
    assert short == {("worker.py", "plan", "balance.py", "micro_batches_for_rank"),
                     ("worker.py", "plan", "balance.py", "with_stand_ins")}
    entered = {Path(path).name: names for path, names in calls.entered.items()}
    assert {"plan", "row_lengths"} <= entered["worker.py"]
    assert {"micro_batches_for_rank", "micro_batch_plan", "rank_shares", "_karmarkar_karp"} <= entered["balance.py"]

    counts = calls.report()
    assert (counts["files"], counts["crossings"]) == (2, 2)
    # minibatch_indices, a function of balance.py the plan never calls, is not in the lines the step ran
    balance = REPO / "workers" / "balance.py"
    ran = step_reading.step_lines(str(balance), calls.first_lines[str(balance)])
    source = balance.read_text().splitlines()
    unused = next(n for n, line in enumerate(source, 1) if line.startswith("def minibatch_indices"))
    assert unused not in ran and counts["step_lines"] < counts["file_lines"]


def test_the_lines_of_an_entered_function_hold_its_decorators_and_nested_functions_once(tmp_path):
    path = tmp_path / "module.py"
    path.write_text("import functools\n"          # 1
                    "\n"                          # 2
                    "@functools.lru_cache\n"      # 3
                    "def outer(x):\n"             # 4
                    "    def inner(y):\n"         # 5
                    "        return y + 1\n"      # 6
                    "    return inner(x)\n"       # 7
                    "\n"                          # 8
                    "def other():\n"              # 9
                    "    return 0\n")             # 10
    # A code object starts at its first decorator (CPython's co_firstlineno); the nested one inside it.
    assert step_reading.step_lines(str(path), {3, 5}) == {3, 4, 5, 6, 7}
    assert step_reading.step_lines(str(path), {5}) == {5, 6}
    assert step_reading.step_lines(str(path), {9}) == {9, 10}
