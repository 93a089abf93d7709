"""Every job's run around its steps (rl_core/training_run.py), on a one-rank gloo group with a real sharded model,
optimizer, checkpoint writer and metrics logger: a fresh run evaluates before training, logs each step once, says
its console line when due and checkpoints the models with the job's own state; a resumed run starts after its
checkpoint with the weights and state it saved, does not evaluate step 0 again, and the export runs before the
logger closes.
"""

import json

import torch

from rl_core.model_builder import Optimization, Placement, build_trained
from rl_core.sft.config import SFTConfig
from rl_core.stop_signal import StepProgress
from rl_core.training_run import ConsoleLine, TrainingRun
from tests.test_checkpoint_integrity import process_group  # noqa: F401  (the one-rank gloo group)


class Job:
    """A job's own part: a real optimizer step per step on the tiny model, a count its checkpoints hold."""

    def __init__(self, model_dir, run_dir, total_steps: int, resume: str):
        cfg = SFTConfig()
        cfg.model.path, cfg.trainer.run_dir, cfg.trainer.resume = model_dir, str(run_dir), resume
        cfg.trainer.save_every = 2
        torch.manual_seed(0)
        self.trainable = build_trained(model_dir, "causal_lm", cfg.model, Placement(),
                                       Optimization("adamw", 1e-2, max_grad_norm=None))
        self.state = {"count": 0}
        self.evaluated, self.lines, self.exported = [], [], []
        self.run = TrainingRun(cfg, 0, {"model": self.trainable}, total_steps,
                               ConsoleLine(("train/loss",), every=3, say=self.lines.append),
                               state=lambda: dict(self.state))
        if self.run.saved:
            self.state.update(self.run.saved)

    def one_step(self, step: int) -> dict:
        ids = torch.arange(1, 9).view(1, 8)
        loss = self.trainable.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.trainable.step()
        self.state["count"] += 1
        return {"train/loss": loss.item()}

    def evaluate(self, step: int) -> dict:
        self.evaluated.append(step)
        return {"eval/loss": float(step)}

    def train(self) -> None:
        self.run.run_steps(self.one_step, torch.device("cpu"), StepProgress(), evaluate=self.evaluate,
                           eval_due=lambda step: step in (0, self.run.total_steps))
        self.run.finish(lambda: self.exported.append(self.run.logger is not None))


def first_weight(trainable) -> torch.Tensor:
    from workers.fsdp import full_state_dict

    return next(iter(full_state_dict(trainable.model).values())).clone()


def logged_steps(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_resumes_with_the_weights_and_state_it_saved_and_logs_every_step_once(process_group, tiny_model_dir,
                                                                                    tmp_path):  # noqa: F811
    first = Job(tiny_model_dir, tmp_path, total_steps=4, resume="never")
    first.train()
    assert first.evaluated == [0, 4]  # the baseline before training, and the end
    assert logged_steps(tmp_path) == [0, 1, 2, 3, 4]
    # Lines at the step-0 evaluation, every 3 steps, the last step.
    assert [line.split("  ")[0] for line in first.lines] == ["step 0/4", "step 3/4", "step 4/4"]
    assert "train/loss=" in first.lines[1]
    assert first.exported == [True]  # the export ran with the logger still open; closed after it
    assert first.run.logger is None
    trained = first_weight(first.trainable)

    resumed = Job(tiny_model_dir, tmp_path, total_steps=6, resume="auto")
    assert resumed.run.start_step == 4 and resumed.state == {"count": 4}  # the job's own state, as saved
    assert torch.equal(first_weight(resumed.trainable), trained)  # the weights of step 4, not a fresh model
    resumed.train()
    assert resumed.evaluated == [6]  # no second baseline on a resumed run
    assert resumed.state["count"] == 6
    assert logged_steps(tmp_path) == [0, 1, 2, 3, 4, 5, 6]
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["step_00000004", "step_00000006"]
