"""On-policy distillation as a user runs it: two steps on 2 ranks with the teacher beside the trainer
(`distill.teacher_path`) and behind a server of its own (`distill.teacher_url`, an embedded engine started as a
separate process); the same sampled batch gets the same teacher logprobs either way."""

import pytest
import torch

from tests.jobs import read_metrics, undocumented_metrics
from tests.ppo.test_job import run_job
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.procs import ManagedProcesses


@pytest.fixture(scope="module")
def teacher_dir(small_job, tmp_path_factory):
    """The small job's policy with its weights perturbed: a teacher of the same tokenizer that disagrees."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student = next(o.split("=", 1)[1] for o in small_job["overrides"] if o.startswith("model.path="))
    out = tmp_path_factory.mktemp("teacher")
    model = AutoModelForCausalLM.from_pretrained(student)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.2)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(student).save_pretrained(out)
    return str(out)


TWO_STEPS = ("trainer.total_episodes=16", "distill.reward_coef=0.5", "distill.coef=1.0")


@pytest.mark.timeout(900)
def test_two_distillation_steps_with_the_teacher_local_and_behind_a_server(small_job, teacher_dir, tmp_path):
    local = tmp_path / "local"
    run_job(small_job, local, *TWO_STEPS, f"distill.teacher_path={teacher_dir}")
    with ManagedProcesses() as procs:
        spec = EngineSpec(kind="embedded", model_path=teacher_dir, dtype="float32", device="cpu", seed=0,
                          num_threads=1)
        url = start_engine(spec, tmp_path / "teacher.log", procs, deadline_s=300).url
        remote = tmp_path / "remote"
        run_job(small_job, remote, *TWO_STEPS, f"distill.teacher_url={url}")
        served = (tmp_path / "teacher.log").read_text()

    rows = {name: read_metrics(run_dir) for name, run_dir in (("local", local), ("remote", remote))}
    for name, metrics in rows.items():
        assert [row["step"] for row in metrics] == [1, 2], name
        assert all(row["distill/reverse_kl"] > 0 and row["distill/teacher_logprob"] < 0 for row in metrics), name
        assert undocumented_metrics(metrics) == []
    # Step 1 samples the same batch in both runs (same weights and seeds): the teacher scores it the same,
    # whether its forward ran sharded on the trainer's ranks or in the server's prefill.
    first_local, first_remote = rows["local"][0], rows["remote"][0]
    for key in ("distill/teacher_logprob", "distill/reverse_kl", "reward/score_mean"):
        assert first_remote[key] == pytest.approx(first_local[key], abs=1e-4), key
    assert served.count("POST /generate") >= 2 * 8  # every sequence of both steps went to the server


@pytest.mark.timeout(600)
def test_the_distillation_recipe_runs_with_its_offline_teacher(arithmetic_job, tmp_path):
    """configs/opd_arithmetic.yaml as shipped, on the small arithmetic assets and the small teacher built from
    them: a step of pure distillation (the reward only measured) between two evaluations."""
    from offline.arithmetic_teacher import ensure_arithmetic_teacher

    teacher = ensure_arithmetic_teacher(arithmetic_job["root"], small=True, log=lambda *_: None)
    run_dir = tmp_path / "opd"
    run_job(arithmetic_job, run_dir, "trainer.total_episodes=16", f"distill.teacher_path={teacher}",
            config="opd_arithmetic.yaml")
    rows = read_metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1]
    assert "eval/accuracy" in rows[0] and "eval/accuracy" in rows[1]
    step = rows[1]
    assert step["distill/reverse_kl"] != 0 and step["distill/teacher_logprob"] < 0
