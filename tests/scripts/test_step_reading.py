"""scripts/step_reading.py's counting (the whole job run is the script's own 20 s; these check what it counts, the
three counts of issue 69 on small packages written for each test, where each count is known and differs)."""

import importlib
import sys
import textwrap
import uuid
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


def record(tmp_path, monkeypatch, modules: dict[str, str]):
    """`modules` (name -> source, `PKG` standing for their package) written as a package of their own, then
    `top.step()` run under the recorder with `step` as the root, `maths.py` the maths and `client.request` the
    HTTP request; the recorder back."""
    package = f"steps_{uuid.uuid4().hex[:8]}"
    folder = tmp_path / package
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for name, source in modules.items():
        (folder / f"{name}.py").write_text(textwrap.dedent(source).replace("PKG", package))
    monkeypatch.syspath_prepend(str(tmp_path))
    top = importlib.import_module(f"{package}.top")
    calls = step_reading.StepCalls(root=top.step.__code__, packages=(f"{folder}/",), maths=str(folder / "maths.py"),
                                   request=(str(folder / "client.py"), "request"))
    calls.recording = True
    sys.setprofile(calls.hook)
    try:
        top.step()
    finally:
        sys.setprofile(None)
    return calls


MATHS = """
    def loss(w):
        return square(w).sum()

    def square(w):  # called from its own file: part of the maths, not an entry into it
        return w * w
"""


def test_max_depth_is_how_far_below_the_root_the_backward_and_the_maths_run(tmp_path, monkeypatch):
    deep = record(tmp_path, monkeypatch, {
        "top": """
            from PKG import phases

            def step():
                return phases.update()
        """,
        "phases": """
            import torch
            from PKG import helpers

            def update():
                return helpers.gradient(torch.ones(2, requires_grad=True))
        """,
        "helpers": """
            from PKG import maths

            def gradient(w):
                maths.loss(w).backward()
                return w.grad
        """,
        "maths": MATHS})
    flat = record(tmp_path, monkeypatch, {
        "top": """
            import torch
            from PKG import maths

            def step():
                w = torch.ones(2, requires_grad=True)
                maths.loss(w).backward()
                return w.grad
        """,
        "maths": MATHS})
    # step -> update (1) -> gradient (2) -> loss and Tensor.backward (3); square, inside the maths, is no entry
    assert step_reading.max_depth(deep.work_paths) == 3
    assert step_reading.max_depth(flat.work_paths) == 1
    kinds = step_reading.deepest_work(deep.work_paths)
    assert set(kinds) == {"_tensor.py:backward", "maths.py:loss"}
    assert [name for _, name in kinds["maths.py:loss"]] == ["step", "update", "gradient", "loss"]
    assert step_reading.max_depth([]) == 0


def test_an_engine_request_is_real_work_where_the_client_sends_it(tmp_path, monkeypatch):
    """The weight push's HTTP: its depth is where the client's `request` runs, however the caller wraps the call
    (a protocol's own coroutine below the push is one frame more)."""
    client = """
        def request(path):
            return len(path)

        def post(path):
            return request(path)
    """
    wrapped = record(tmp_path, monkeypatch, {
        "top": """
            from PKG import engine

            def step():
                return engine.push()
        """,
        "engine": """
            from PKG import client

            def push():
                return protocol()

            def protocol():
                return client.post("/update_weights_from_tensor")
        """,
        "client": client})
    flat = record(tmp_path, monkeypatch, {
        "top": """
            from PKG import engine

            def step():
                return engine.push()
        """,
        "engine": """
            from PKG import client

            def push():
                return client.request("/update_weights_from_tensor")
        """,
        "client": client})
    # push (1) -> protocol (2) -> post (3) -> request (4); push (1) -> request (2)
    assert step_reading.max_depth(wrapped.work_paths) == 4
    assert step_reading.max_depth(flat.work_paths) == 2
    assert set(step_reading.deepest_work(flat.work_paths)) == {"client.py:request"}


def test_a_reentry_is_a_call_back_into_a_file_the_path_left(tmp_path, monkeypatch):
    back = record(tmp_path, monkeypatch, {
        "top": """
            from PKG import worker

            def step():
                return worker.each([1, 2], loss)

            def loss(x):
                return double(x)  # within top.py: no re-entry of its own

            def double(x):
                return 2 * x
        """,
        "worker": """
            def each(items, fn):
                return [fn(item) for item in items]
        """})
    owned = record(tmp_path, monkeypatch, {
        "top": """
            from PKG import worker

            def step():
                return worker.each([1, 2])
        """,
        "worker": """
            from PKG import losses

            def each(items):
                return [losses.loss(item) for item in items]
        """,
        "losses": """
            def loss(x):
                return 2 * x
        """})
    found = step_reading.reentries(back.paths)
    assert {(Path(a).name, Path(b).name, fb) for a, _, b, fb in found} == {("worker.py", "top.py", "loss")}
    assert step_reading.reentries(owned.paths) == set()
    # counted on the path, not by the edge alone: a -> b -> a re-enters a, a -> b -> c -> b re-enters b
    a, b, c = ("a.py", "f"), ("b.py", "g"), ("c.py", "h")
    assert step_reading.reentries([(a, b, a)]) == {("b.py", "g", "a.py", "f")}
    assert step_reading.reentries([(a, b, c, b)]) == {("c.py", "h", "b.py", "g")}
    assert step_reading.reentries([(a, b, c), (a, c)]) == set()


LAYOUT = """
    import dataclasses
    import torch

    @dataclasses.dataclass
    class Batch:
        input_ids: torch.Tensor

    def collate(rows):
        return Batch(torch.tensor([[1, 2], [4, 0]]))

    def model_inputs(batch):
        return {"input_ids": batch.input_ids, "use_cache": False}
"""


def test_batch_forms_are_the_classes_and_key_sets_the_rows_take_between_files(tmp_path, monkeypatch):
    rows = '[{"prompt_ids": [1, 2], "answer": "3"}, {"prompt_ids": [4], "answer": "5"}]'
    three = record(tmp_path, monkeypatch, {
        "top": f"""
            from PKG import layout, losses

            def step():
                return losses.loss(layout.collate({rows}))
        """,
        "layout": LAYOUT,
        "losses": """
            from PKG import layout

            def loss(batch):
                return layout.model_inputs(batch)["input_ids"].sum()
        """})
    one = record(tmp_path, monkeypatch, {
        "top": f"""
            import torch
            from PKG import layout, losses

            def step():
                return losses.loss(layout.collate({rows}))
        """,
        "layout": """
            import torch

            def collate(rows):  # the rows' keys, as tensors, with a mask added
                return {"prompt_ids": torch.tensor([[1, 2], [4, 0]]), "answer": ["3", "5"],
                        "mask": torch.tensor([[1, 1], [1, 0]])}

            def model_inputs(batch):  # some of the batch's keys
                return {"prompt_ids": batch["prompt_ids"], "mask": batch["mask"]}
        """,
        "losses": """
            from PKG import layout

            def loss(batch):
                return layout.model_inputs(batch)["prompt_ids"].sum()
        """})
    assert sorted(map(step_reading.form_name, three.forms)) == ["Batch", "dict(answer, prompt_ids)",
                                                                "dict(input_ids, use_cache)"]
    assert len(step_reading.form_groups(three.forms)) == 3
    assert len(step_reading.form_groups(one.forms)) == 1  # three key sets, each holding or held by the batch's


def test_what_is_no_batch_form():
    forms_of = step_reading.forms_of
    assert forms_of([{"role": "user", "content": "2+2?"}]) == set()  # chat messages: text, no values per token
    assert forms_of({"loss": [torch.tensor(1.0)], "lr": 0.1}) == set()  # metrics
    assert forms_of({"input_ids": [1, 2, 3]}) == set()  # one row alone
    assert forms_of(([{"ids": [1]}], {"n": 1})) == {frozenset({"ids"})}  # a tuple: what it holds
    assert forms_of({"input_ids": torch.ones(2, 3)}) == {frozenset({"input_ids"})}
    a, ab, bc, d = frozenset("a"), frozenset("ab"), frozenset("bc"), frozenset("d")
    assert len(step_reading.form_groups([a, ab, d, "Batch"])) == 3
    assert len(step_reading.form_groups([a, bc, ab])) == 2  # a within ab; bc holds neither
    assert len(step_reading.form_groups([a, frozenset("abc"), bc])) == 1  # both within abc


def test_a_dict_subclass_is_the_form_of_its_keys():
    """The micro-batch is a project class and a dict (its rows laid out, its forward settings beside them): a dict
    by its keys, so selecting or laying out the rows keeps their form; a project class that is no dict is its own."""
    from workers.forward import ForwardSettings, MicroBatch

    rows = {"input_ids": torch.ones(2, 3), "action_mask": torch.ones(2, 3)}
    laid_out = MicroBatch({**rows, "packed_index": torch.ones(2, 3)}, ForwardSettings())
    assert step_reading.forms_of(laid_out) == {frozenset({"input_ids", "action_mask", "packed_index"})}
    assert len(step_reading.form_groups(step_reading.forms_of(rows) | step_reading.forms_of(laid_out))) == 1
