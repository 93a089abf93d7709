"""How many files a reader opens to follow one PPO step, how often the step crosses between them, how deep
its work lies and how many forms its batch takes.

    .venv/bin/python scripts/step_reading.py [--main-thread] [--config grpo_arithmetic.yaml] [key=value ...]

Runs the PPO job as a world of one (the offline assets, the embedded engine, 2 steps) and records,
during its second step, every call made by this project's code (rl_core/, workers/, envs/) in any
thread of the trainer's process: the rollout's event loop included, the engine's own process not.
A crossing is a call from one project file into a different one (the nearest project frame up the
stack is the caller, so a call through torch or asyncio still counts); each distinct call edge
(caller file and function -> callee file and function) is counted once, as a reader follows it once.

`--main-thread` records the trainer's main thread alone: the step as `ppo_step` calls it, with the rollout's
event loop, env and reward threads left out (what a reader following `ppo_step` down its own calls opens).

Three counts follow the step's call path: the project frames from `ppo_step` down to a call (the frames of
torch, asyncio or the standard library between them skipped; a thread's calls are below `ppo_step` only when
its frames are, so in practice these count the main thread):

- `max_depth`: how far below `ppo_step` the step's real work happens: the most frames on the path of a call that
  does real work, `ppo_step`'s own callee counted 1 and the call itself counted. Real work (`WORK`): autograd's
  backward (torch's `Tensor.backward`), an HTTP request (`EngineClient.request`, the one function that sends
  every engine call, the weight push's included, its body aiohttp's request; urllib's `urlopen` for any other)
  and the loss and advantage maths (a function of `rl_core/ppo/algorithms.py` called from another file).
- `reentries`: the distinct call edges that enter a file already on the path above the caller: a file left
  and entered again (A -> B -> A), the loss computed in `step.py` below `worker.py` below `step.py`, say.
- `batch_forms`: how many forms the step's rows take on their way from the prompt rows to the loss, counted on
  every crossing while the step is recorded: the callee's arguments (`self` left out) and its return value.
  A value is a form of the batch (`forms_of`) when it is a list of rows (a row: a dict or an instance of a
  project class that holds values per token, a tensor or a list of numbers, or rows of its own, as a trajectory
  its sequences; the list is its rows' form), or a dict or a project object that holds the batch (a tensor of
  two or more dimensions, a dict of them or a list of rows among its values); a tuple is the values it holds.
  A row alone is not the batch, and a chat message or a row of text alone is no row. A project class is one
  form; dicts are forms by their keys (a project class that is a dict too: the micro-batch, its rows laid out
  with its forward settings beside them), and two key sets are one form when one holds the other (`form_groups`:
  the same batch with keys added or selected).

Prints the files (with the lines of each that the step ran) and the functions entered in each, the distinct
crossings, the deepest path of each kind of work, the re-entering edges, the batch forms (each with where it was
passed), and one JSON line: {"files": F, "crossings": C, "functions": N, "step_lines": S, "file_lines": L,
"max_depth": D, "reentries": R, "batch_forms": B}, S the lines of the functions the step ran (a nested one
counted once), L the lines of the files holding them: how few files of capped length the step's code alone
would need, against how many its modules fill.
Hand-written on sys.setprofile because a profiler's per-function totals lose the caller of each call, which
is the crossing.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import torch

REPO = Path(__file__).resolve().parents[1]
PACKAGES = tuple(str(REPO / name) + "/" for name in ("rl_core", "workers", "envs"))
DEFAULT = ["--config", "grpo_arithmetic.yaml", "algorithm.batch_size=16", "algorithm.group_size=4",
           "env.num_envs=8", "trainer.total_episodes=32", "data.eval_path=null", "eval.every=0",
           "trainer.progress=false", "trainer.export_hf=false", "trainer.log_samples_every=0"]
# Real work done outside the project: a function's name -> how its file's path ends.
WORK = {"backward": "torch/_tensor.py", "urlopen": "urllib/request.py"}
MATHS = str(REPO / "rl_core" / "ppo" / "algorithms.py")  # the loss and advantage maths: real work too
# The project's one function that sends an engine (or router) an HTTP request: aiohttp's request is its body.
REQUEST = (str(REPO / "workers" / "engines" / "client.py"), "request")

CallPath = tuple[tuple[str, str], ...]  # (file, function) of each project frame from the root down
Edge = tuple[str, str, str, str]  # caller file and function -> callee file and function
Form = str | frozenset  # a project class's name, or a dict's keys


class StepCalls:
    """The project's calls while `recording` is set, from every thread that runs Python.

    `root`: the code of the function the call paths start at (`ppo_step`'s); None: each thread's outermost
    project frame. `packages`: the project's folders; `maths`: the file whose functions are real work; `request`: the
    (file, function) that sends an HTTP request."""

    def __init__(self, root=None, packages: tuple[str, ...] = PACKAGES, maths: str = MATHS,
                 request: tuple[str, str] = REQUEST):
        self.root, self.packages, self.maths, self.request = root, packages, maths, request
        self.recording = False
        self.edges: set[Edge] = set()
        self.entered: dict[str, set[str]] = defaultdict(set)
        self.first_lines: dict[str, set[int]] = defaultdict(set)  # where each entered function starts
        self.paths: set[CallPath] = set()  # the path of every project call below the root
        self.work_paths: set[CallPath] = set()  # the path of every call doing real work, that call last
        self.forms: dict[Form, set[str]] = defaultdict(set)  # batch form -> the functions it went to or came from

    def hook(self, frame, event, arg):
        if not self.recording or event not in ("call", "return"):
            return
        code = frame.f_code
        callee = code.co_filename
        if not callee.startswith(self.packages):
            if event == "call" and callee.endswith(WORK.get(code.co_name, "\0")):
                path = self.call_path(frame)
                if path is not None:
                    self.work_paths.add(path)
            return
        caller = self.project_caller(frame)
        crossing = caller is not None and caller.f_code.co_filename != callee
        if crossing:  # what one file hands another: the arguments on the way in, the value on the way out
            for value in (arguments(frame) if event == "call" else [arg]):
                for form in forms_of(value, self.packages):
                    self.forms[form].add(f"{short(callee)}:{code.co_name}")
        if event == "return":
            return
        self.entered[callee].add(code.co_name)
        self.first_lines[callee].add(code.co_firstlineno)
        if crossing:
            self.edges.add((caller.f_code.co_filename, caller.f_code.co_name, callee, code.co_name))
        path = self.call_path(frame)
        if path is not None:
            self.paths.add(path)
            maths = callee == self.maths and not (caller is not None and caller.f_code.co_filename == self.maths)
            if maths or (callee, code.co_name) == self.request:
                self.work_paths.add(path)

    def project_caller(self, frame):
        """The nearest project frame above `frame` (its caller, through any frames of torch or asyncio)."""
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(self.packages):
            caller = caller.f_back
        return caller

    def call_path(self, frame) -> CallPath | None:
        """The project frames from the root down to `frame` (itself last, whatever its file); None when the root
        is not above it."""
        path, up = [], frame
        while up is not None:
            code = up.f_code
            if up is frame or code.co_filename.startswith(self.packages):
                path.append((code.co_filename, code.co_name))
            if code is self.root:
                return tuple(reversed(path))
            up = up.f_back
        return tuple(reversed(path)) if self.root is None else None

    def report(self) -> dict:
        ran = {path: len(step_lines(path, self.first_lines[path])) for path in self.entered}
        held = {path: len(Path(path).read_text().splitlines()) for path in self.entered}
        for path in sorted(self.entered):
            print(f"{short(path)} ({ran[path]} of {held[path]} lines): {', '.join(sorted(self.entered[path]))}")
        print()
        for caller, caller_fn, callee, callee_fn in sorted(self.edges):
            print(f"{short(caller)}:{caller_fn} -> {short(callee)}:{callee_fn}")
        print("\nthe deepest path to each kind of real work:")
        for kind, path in sorted(deepest_work(self.work_paths).items()):
            print(f"{kind} at depth {len(path) - 1}: " + " -> ".join(f"{short(f)}:{fn}" for f, fn in path))
        returns = reentries(self.paths)
        print(f"\n{len(returns)} calls into a file already on the path above:")
        for caller, caller_fn, callee, callee_fn in sorted(returns):
            print(f"{short(caller)}:{caller_fn} -> {short(callee)}:{callee_fn}")
        groups = form_groups(self.forms)
        print(f"\n{len(groups)} batch forms (dicts by their keys), each with the functions it went to or came from:")
        for number, group in enumerate(groups, 1):
            for form in sorted(group, key=form_name):
                print(f"{number}. {form_name(form)}: {', '.join(sorted(self.forms[form]))}")
        return {"files": len(self.entered), "crossings": len(self.edges),
                "functions": sum(len(names) for names in self.entered.values()),
                "step_lines": sum(ran.values()), "file_lines": sum(held.values()),
                "max_depth": max_depth(self.work_paths), "reentries": len(returns),
                "batch_forms": len(groups)}


def short(path: str) -> str:
    """A file as the listing names it: relative to the repository when it is in it."""
    return str(Path(path).relative_to(REPO)) if path.startswith(str(REPO) + "/") else path


def arguments(frame) -> list:
    """The values a call was given (its parameters as the call starts), `self` and `cls` left out."""
    code = frame.f_code
    count = (code.co_argcount + code.co_kwonlyargcount + bool(code.co_flags & inspect.CO_VARARGS)
             + bool(code.co_flags & inspect.CO_VARKEYWORDS))
    local = frame.f_locals
    return [local[name] for name in code.co_varnames[:count] if name not in ("self", "cls") and name in local]


def shape(value, packages: tuple[str, ...] = PACKAGES) -> Form | None:
    """What tells forms apart: a dict's keys (a dict subclass's too), a project class's name (a torch module is no
    data); None for the rest."""
    if isinstance(value, torch.nn.Module):
        return None
    if isinstance(value, dict) and value and all(isinstance(key, str) for key in value):
        return frozenset(value)  # a project dict subclass too: its keys are its rows, whatever travels beside them
    module = sys.modules.get(type(value).__module__)
    if getattr(module, "__file__", None) and module.__file__.startswith(packages):
        return type(value).__qualname__
    return None


def contents(value) -> list:
    """A dict's values, an object's attributes."""
    if isinstance(value, dict):
        return list(value.values())
    return list(vars(value).values()) if hasattr(value, "__dict__") else []


def per_token(value) -> bool:
    """Values per token (or per row): a tensor, or a list of numbers."""
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1
    return isinstance(value, list) and bool(value) and isinstance(value[0], (int, float)) \
        and not isinstance(value[0], bool)


def row_form(value, packages: tuple[str, ...] = PACKAGES, depth: int = 0) -> Form | None:
    """`value`'s form as a row of the batch: a project object or a dict that holds values per token, or rows
    (a trajectory its sequences); None for anything else (a chat message, a row of text alone)."""
    form = shape(value, packages)
    if form is None or depth > 2:
        return None
    for item in contents(value):
        if per_token(item) or (isinstance(item, list) and any(row_form(row, packages, depth + 1) is not None
                                                                for row in item[:3])):
            return form
    return None


def holds_batch(value, packages: tuple[str, ...] = PACKAGES) -> bool:
    """Whether a dict's values or an object's attributes hold the batch: token-level tensors (two or more
    dimensions, or a dict of them) or a list of rows."""
    for item in contents(value):
        if isinstance(item, torch.Tensor) and item.dim() >= 2:
            return True
        if isinstance(item, dict) and any(isinstance(v, torch.Tensor) and v.dim() >= 2 for v in item.values()):
            return True
        if isinstance(item, list) and any(row_form(row, packages) is not None for row in item[:3]):
            return True
    return False


def forms_of(value, packages: tuple[str, ...] = PACKAGES) -> set[Form]:
    """The batch forms `value` is: a list of rows is its rows' forms, a tuple the forms of what it holds, a
    dict or project object one form when it holds the batch (`holds_batch`); a row alone is none."""
    if isinstance(value, tuple) and shape(value, packages) is None:
        return set().union(*(forms_of(item, packages) for item in value))
    if isinstance(value, list):
        return {form for item in value[:3] if (form := row_form(item, packages)) is not None}
    form = shape(value, packages)
    return {form} if form is not None and holds_batch(value, packages) else set()


def form_name(form: Form) -> str:
    return form if isinstance(form, str) else "dict(" + ", ".join(sorted(form)) + ")"


def form_groups(forms: Iterable[Form]) -> list[list[Form]]:
    """The distinct batch forms, each a group: a class alone, dicts together when their key sets hold one another
    (a batch's keys, its rows' with keys added, a minibatch's selected: one form), directly or through others."""
    groups: list[list[Form]] = []
    for form in sorted(set(forms), key=form_name):
        joined = [group for group in groups if isinstance(form, frozenset) and any(
            isinstance(other, frozenset) and (form <= other or other <= form) for other in group)]
        groups = [group for group in groups if group not in joined] + [[form] + [f for g in joined for f in g]]
    return sorted(groups, key=lambda group: form_name(group[0]))


def reentries(paths: Iterable[CallPath]) -> set[Edge]:
    """The call edges on `paths` whose callee's file is already on the path above the caller, and is not the
    caller's own: a file left and entered again (A -> B -> A)."""
    found = set()
    for path in paths:
        for depth in range(2, len(path)):
            (caller, caller_fn), (callee, callee_fn) = path[depth - 1], path[depth]
            if callee != caller and any(file == callee for file, _ in path[:depth - 1]):
                found.add((caller, caller_fn, callee, callee_fn))
    return found


def max_depth(work_paths: Iterable[CallPath]) -> int:
    """How many frames below the root the deepest real work lies (the root's own callee is 1); 0 without any."""
    return max((len(path) - 1 for path in work_paths), default=0)


def deepest_work(work_paths: Iterable[CallPath]) -> dict[str, CallPath]:
    """Each kind of real work (the function doing it, by file and name) and its deepest path."""
    deepest: dict[str, CallPath] = {}
    for path in work_paths:
        kind = f"{Path(path[-1][0]).name}:{path[-1][1]}"
        if kind not in deepest or len(path) > len(deepest[kind]):
            deepest[kind] = path
    return deepest


def step_lines(path: str, first_lines: set[int]) -> set[int]:
    """The line numbers of the functions (decorators included) whose code starts at one of `first_lines`
    (a code object's `co_firstlineno` is its first decorator's line)."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            if start in first_lines:
                lines.update(range(start, node.end_lineno + 1))
    return lines


def main(argv: list[str]) -> None:
    main_thread_only = "--main-thread" in argv
    argv = [arg for arg in argv if arg != "--main-thread"]
    import rl_core.ppo.job as ppo_job
    from rl_core.offline_names import offline_resolver

    one_step = ppo_job.ppo_step
    calls = StepCalls(root=one_step.__code__)
    if not main_thread_only:
        threading.setprofile(calls.hook)  # threads started from here on: the rollout loop, env and reward threads
    sys.setprofile(calls.hook)

    def recorded_step(job, rt, step, progress):
        calls.recording = step == 1  # the second step: the first also pays for first-use set-up
        try:
            return one_step(job, rt, step, progress)
        finally:
            if calls.recording:  # said now: the job ends its process with os._exit
                calls.recording = False
                print(json.dumps(calls.report()), flush=True)

    ppo_job.ppo_step = recorded_step  # train() looks the step up by name at each call
    with tempfile.TemporaryDirectory(prefix="step-reading-") as run_dir:
        ppo_job.main([*(argv or DEFAULT), f"trainer.run_dir={run_dir}"], prepare=offline_resolver("ppo"))


if __name__ == "__main__":
    main(sys.argv[1:])
