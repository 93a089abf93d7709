"""On-policy distillation as a user runs it: `configs/opd_arithmetic.yaml` as shipped (on the small arithmetic
assets and the small teacher built from them), two steps on 2 ranks with the teacher beside the trainer
(`distill.teacher_path`) and behind a server of its own (`distill.teacher_url`, an embedded engine started as a
separate process); the same sampled batch gets the same teacher logprobs either way."""

import pytest

from tests.jobs import read_metrics, undocumented_metrics
from tests.ppo.test_job import run_job
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.procs import ManagedProcesses

TWO_STEPS = ("trainer.total_episodes=32", "eval.every=0")


@pytest.mark.timeout(900)
def test_two_distillation_steps_with_the_teacher_local_and_behind_a_server(arithmetic_job, tmp_path):
    from offline.arithmetic_teacher import ensure_arithmetic_teacher

    teacher = str(ensure_arithmetic_teacher(arithmetic_job["root"], small=True, log=lambda *_: None))
    local = tmp_path / "local"
    run_job(arithmetic_job, local, *TWO_STEPS, f"distill.teacher_path={teacher}", config="opd_arithmetic.yaml")
    with ManagedProcesses() as procs:
        spec = EngineSpec(kind="embedded", model_path=teacher, dtype="float32", device="cpu", seed=0, num_threads=1)
        url = start_engine(spec, tmp_path / "teacher.log", procs, deadline_s=300).url
        remote = tmp_path / "remote"
        run_job(arithmetic_job, remote, *TWO_STEPS, "distill.teacher_path=null", f"distill.teacher_url={url}",
                config="opd_arithmetic.yaml")
        served = (tmp_path / "teacher.log").read_text()

    rows = {name: read_metrics(run_dir) for name, run_dir in (("local", local), ("remote", remote))}
    for name, metrics in rows.items():
        assert [row["step"] for row in metrics] == [0, 1, 2], name
        assert "eval/accuracy" in metrics[0] and "eval/accuracy" in metrics[-1], name  # the recipe's evaluations
        steps = metrics[1:]
        assert all(row["distill/reverse_kl"] != 0 and row["distill/teacher_logprob"] < 0 for row in steps), name
        assert undocumented_metrics(metrics) == []
    # Step 1 samples the same batch in both runs (same weights and seeds): the teacher scores it the same,
    # whether its forward ran sharded on the trainer's ranks or in the server's prefill.
    first_local, first_remote = rows["local"][1], rows["remote"][1]
    for key in ("distill/teacher_logprob", "distill/reverse_kl", "reward/fn_total_mean"):
        assert first_remote[key] == pytest.approx(first_local[key], abs=1e-4), key
    assert served.count("POST /generate") >= 2 * 16  # every sequence of both steps went to the server
