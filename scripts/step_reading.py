"""How many files a reader opens to follow one PPO step, and how often the step crosses between them.

    .venv/bin/python scripts/step_reading.py [--main-thread] [--config grpo_arithmetic.yaml] [key=value ...]

Runs the PPO job as a world of one (the offline assets, the embedded engine, 2 steps) and records,
during its second step, every call made by this project's code (rl_core/, workers/, envs/) in any
thread of the trainer's process: the rollout's event loop included, the engine's own process not.
A crossing is a call from one project file into a different one (the nearest project frame up the
stack is the caller, so a call through torch or asyncio still counts); each distinct call edge
(caller file and function -> callee file and function) is counted once, as a reader follows it once.

`--main-thread` records the trainer's main thread alone: the step as `ppo_step` calls it, with the rollout's
event loop, env and reward threads left out (what a reader following `ppo_step` down its own calls opens).

Prints the files (with the lines of each that the step ran) and the functions entered in each, the distinct
crossings, and one JSON line: {"files": F, "crossings": C, "functions": N, "step_lines": S, "file_lines": L},
S the lines of the functions the step ran (a nested one counted once), L the lines of the files holding them:
how few files of capped length the step's code alone would need, against how many its modules fill.
Hand-written on sys.setprofile because a profiler's per-function totals lose the caller of each call, which
is the crossing.
"""

from __future__ import annotations

import ast
import json
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = tuple(str(REPO / name) + "/" for name in ("rl_core", "workers", "envs"))
DEFAULT = ["--config", "grpo_arithmetic.yaml", "algorithm.batch_size=16", "algorithm.group_size=4",
           "env.num_envs=8", "trainer.total_episodes=32", "data.eval_path=null", "eval.every=0",
           "trainer.progress=false", "trainer.export_hf=false", "trainer.log_samples_every=0"]


class StepCalls:
    """The project's calls while `recording` is set, from every thread that runs Python."""

    def __init__(self):
        self.recording = False
        self.edges: set[tuple[str, str, str, str]] = set()
        self.entered: dict[str, set[str]] = defaultdict(set)
        self.first_lines: dict[str, set[int]] = defaultdict(set)  # where each entered function starts

    def hook(self, frame, event, arg):
        if not self.recording or event != "call":
            return
        callee = frame.f_code.co_filename
        if not callee.startswith(PACKAGES):
            return
        self.entered[callee].add(frame.f_code.co_name)
        self.first_lines[callee].add(frame.f_code.co_firstlineno)
        caller = frame.f_back
        while caller is not None and not caller.f_code.co_filename.startswith(PACKAGES):
            caller = caller.f_back
        if caller is not None and caller.f_code.co_filename != callee:
            self.edges.add((caller.f_code.co_filename, caller.f_code.co_name, callee, frame.f_code.co_name))

    def report(self) -> dict:
        short = lambda path: str(Path(path).relative_to(REPO))  # noqa: E731
        ran = {path: len(step_lines(path, self.first_lines[path])) for path in self.entered}
        held = {path: len(Path(path).read_text().splitlines()) for path in self.entered}
        for path in sorted(self.entered):
            print(f"{short(path)} ({ran[path]} of {held[path]} lines): {', '.join(sorted(self.entered[path]))}")
        print()
        for caller, caller_fn, callee, callee_fn in sorted(self.edges):
            print(f"{short(caller)}:{caller_fn} -> {short(callee)}:{callee_fn}")
        return {"files": len(self.entered), "crossings": len(self.edges),
                "functions": sum(len(names) for names in self.entered.values()),
                "step_lines": sum(ran.values()), "file_lines": sum(held.values())}


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
    calls = StepCalls()
    main_thread_only = "--main-thread" in argv
    argv = [arg for arg in argv if arg != "--main-thread"]
    if not main_thread_only:
        threading.setprofile(calls.hook)  # threads started from here on: the rollout loop, env and reward threads
    sys.setprofile(calls.hook)
    import rl_core.ppo.job as ppo_job
    from rl_core.offline_names import offline_resolver

    one_step = ppo_job.ppo_step

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
