"""The PPO job end to end: torchrun, 2 ranks on gloo, real embedded engines and router, small settings."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import read_metrics, run_to_end, torchrun
from tests.ppo.conftest import ASYNC_RUN, SYNC_RUN

REPO = Path(__file__).resolve().parents[2]
REQUIRED_METRICS = ("step", "reward/score_mean", "reward/total_mean", "kl/mean", "kl/coef", "policy/entropy",
                    "policy/clipfrac", "value/loss", "perf/rollout_s", "perf/train_s", "perf/step_s",
                    "perf/tokens_per_s")


def torchrun_argv(overrides, config="ppo_sentiment.yaml", ranks=2):
    return torchrun("rl_core.train", config, *overrides, ranks=ranks)


def run_job(small_job, run_dir, *extra, timeout=420, config="ppo_sentiment.yaml"):
    overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", *extra]
    return run_to_end(torchrun_argv(overrides, config), timeout)


def project_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line mentions `marker` (engines, router, ranks)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline and ("workers.engines" in cmdline or "sglang" in cmdline or "rl_core.train" in cmdline):
            pids.append(int(entry.name))
    return pids


def wait_gone(marker: str, seconds: float = 20.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while project_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    return project_processes(marker)


# SGLang's native API as the reference lists it: the only paths the job may call on an engine.
SGLANG_PATHS = {"/generate", "/health", "/health_generate", "/get_server_info", "/server_info", "/get_model_info",
                "/model_info", "/flush_cache", "/pause_generation", "/continue_generation",
                "/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
                "/end_weight_update", "/update_weights_from_tensor"}
STEP = re.compile(r"R\(kv_cache,weights\) M\(weights\) B U+ E M\(kv_cache\)")


def engine_calls(log_text: str) -> str:
    """The control calls an engine logged, one letter each: Release, resuMe, Begin, Update, End."""
    letters = {"/release_memory_occupation": "R", "/resume_memory_occupation": "M", "/begin_weight_update": "B",
               "/update_weights_from_tensor": "U", "/end_weight_update": "E", "/pause_generation": "P",
               "/continue_generation": "C"}
    calls = []
    for path, tags in re.findall(r"call (/\w+)(?: tags=(\S+))?", log_text):
        calls.append(letters[path] + (f"({tags})" if tags else ""))
    return " ".join(calls)


@pytest.mark.timeout(600)
def test_sync_steps_follow_the_gpu_engine_protocol_and_write_outputs(small_job, sync_run):
    run_dir, _ = sync_run
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["memory/released"] == 1.0 for m in metrics)
    for key in REQUIRED_METRICS:
        assert all(key in m for m in metrics), key
    assert metrics[1]["kl/mean"] != 0.0  # the policy moved away from the reference after one update
    # Every step, on every rank: release -> resume weights -> push session -> resume KV cache, then a probe
    # whose logprobs match the trainer's.
    for rank in (0, 1):
        log = (run_dir / "logs" / f"engine-rank{rank}.log").read_text()
        calls = engine_calls(log)
        first_push, steps = calls.split(" R(", 1)[0], "R(" + calls.split(" R(", 1)[1]
        assert re.fullmatch(r"B U+ E", first_push), calls  # version 0 after start (or resume)
        assert re.fullmatch(rf"{STEP.pattern}( {STEP.pattern}){{2}}", steps), calls
        assert set(re.findall(r"first call of \w+ (/\S+)", log)) <= SGLANG_PATHS, log
    assert all(0 <= m["weight_sync/probe_gap"] < 1e-3 for m in metrics)
    # Sync, and the probe says engine and trainer agree: pi_old is the engine's logprobs, not recomputed.
    assert all(m["perf/old_logprobs_from_engine"] == 1.0 for m in metrics)
    assert (run_dir / "config.yaml").is_file() and (run_dir / "tensorboard").is_dir()
    # trainer.keep_last=2 (the default): only the newest two checkpoints stay on disk.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [f"step_0000000{i}" for i in (2, 3)]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(run_dir / "final")
    assert AutoTokenizer.from_pretrained(run_dir / "final").pad_token == "[PAD]"
    assert wait_gone(str(small_job["root"])) == []
    subprocess.run([sys.executable, str(REPO / "scripts" / "plot_metrics.py"), str(run_dir)], check=True, timeout=120)
    assert (run_dir / "learning_curves.png").stat().st_size > 10_000


@pytest.mark.timeout(600)
@pytest.mark.parametrize("partial", ["false", "true"])
def test_async_mode_respects_staleness_bound(small_job, async_run, tmp_path, partial):
    if partial == "false":
        run_dir, _ = async_run
    else:
        run_dir = tmp_path / "async"
        run_job(small_job, run_dir, *ASYNC_RUN, "async.partial_rollout=true")
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert all(m["async/staleness_max"] <= 1 for m in metrics)
    # Nothing generated only to be dropped: the producer starts a batch only when it will be fresh enough,
    # at most max_staleness batches ahead of the one being taken.
    assert all(m["async/dropped_stale"] == 0 and m["async/batches_generated"] <= m["step"] + 1 for m in metrics), metrics
    assert all(m["perf/old_logprobs_from_engine"] == 0.0 for m in metrics)  # stale engines: pi_old recomputed
    # The resume point is after the batches the trainer took, not the producer's (which runs
    # ahead with queued batches): a resumed run regenerates what was never trained on.
    for m in metrics:
        state = json.loads((run_dir / "checkpoints" / f"step_{m['step']:08d}" / "trainer_state.json").read_text())
        assert state["prompts"]["served"] == 8 * m["async/batches_taken"], (m, state)
    assert wait_gone(str(small_job["root"])) == []


@pytest.mark.timeout(600)
def test_recomputed_old_logprobs_are_the_engines_in_sync_mode(slow_prepare_run):
    """What makes `algorithm.old_logprobs=auto` safe here: recomputed, pi_old equals the engine's
    sampling logprobs on every generated token (the CPU engines and the trainer agree exactly)."""
    run_dir, _ = slow_prepare_run
    metrics = read_metrics(run_dir)
    assert [m["perf/old_logprobs_from_engine"] for m in metrics] == [0.0, 0.0]
    assert all(m["rollout/behaviour_logprob_gap"] < 1e-5 for m in metrics), metrics
    assert all(m["weight_sync/probe_gap"] <= 1e-5 for m in metrics)


def test_old_logprobs_come_from_the_engine_only_when_they_are_the_trainers():
    from rl_core.ppo.config import PPOConfig
    from rl_core.ppo.config import engine_old_logprobs_max_gap

    def old_logprobs_from_engine(cfg, probe_gap):
        return probe_gap <= engine_old_logprobs_max_gap(cfg)

    cfg = PPOConfig()
    assert cfg.algorithm.old_logprobs == "auto" and cfg.trainer.mode == "sync"
    assert old_logprobs_from_engine(cfg, probe_gap=0.0)
    assert not old_logprobs_from_engine(cfg, probe_gap=0.05)  # bf16 engine vs fp32 trainer: recompute
    assert not old_logprobs_from_engine(cfg, probe_gap=float("inf"))  # no push measured yet
    cfg.trainer.mode = "async"
    assert not old_logprobs_from_engine(cfg, probe_gap=0.0)  # stale engines sampled the batch
    cfg.algorithm.old_logprobs = "engine"
    assert old_logprobs_from_engine(cfg, probe_gap=0.05)  # the user's choice, even then
    cfg.trainer.mode, cfg.algorithm.old_logprobs = "sync", "trainer"
    assert not old_logprobs_from_engine(cfg, probe_gap=0.0)


@pytest.mark.timeout(900)
def test_resume_after_sigterm_continues_step_count_and_reproduces_metrics(small_job, sync_run, tmp_path):
    common = list(SYNC_RUN)
    reference = read_metrics(sync_run[0])  # the same run, uninterrupted

    run_dir = tmp_path / "killed"
    overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", *common]
    proc = subprocess.Popen(torchrun_argv(overrides), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    deadline = time.monotonic() + 400
    while not checkpoint.is_dir() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert checkpoint.is_dir(), "the run never wrote its second checkpoint"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert wait_gone(str(small_job["root"])) == [], "engines or router outlived SIGTERM"

    run_job(small_job, run_dir, *common, "trainer.resume=auto")
    resumed = read_metrics(run_dir)
    steps = [m["step"] for m in resumed]
    assert steps[-1] == 3 and steps.count(3) == 1  # continued at step 3, not from 1
    last, expected = resumed[-1], reference[-1]
    for key in ("reward/score_mean", "kl/mean", "policy/entropy"):
        assert last[key] == pytest.approx(expected[key], rel=0.05, abs=1e-3), key


@pytest.mark.timeout(600)
def test_two_nodes_on_one_machine_share_the_router(small_job, tmp_path):
    """Two torchrun launches (node 0 and node 1) rendezvous on localhost; rank 1's engine registers
    with rank 0's router. Engines bind the node address given by rollout.multi_node_host."""
    from workers.net import free_port

    run_dir = tmp_path / "multinode"
    port = free_port()
    overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", "trainer.total_episodes=16",
                                          "rollout.multi_node_host=127.0.0.1"]
    nodes = []
    for node_rank in (0, 1):
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
                "--node_rank", str(node_rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
                "-m", "rl_core.train", "--config", "ppo_sentiment.yaml", *overrides]
        nodes.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    try:
        for proc in nodes:
            outputs.append(proc.communicate(timeout=420)[0])
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    registered = json.loads((run_dir / "logs" / "engines.json").read_text())
    urls = sorted(w["url"] for w in registered["workers"])
    assert len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls), registered
    assert sorted(Path(w["log"]).name for w in registered["workers"]) == ["engine-rank0.log", "engine-rank1.log"]
    assert wait_gone(str(small_job["root"])) == []


@pytest.mark.timeout(600)
def test_dead_engine_stops_the_job_with_its_name_and_log(small_job, tmp_path):
    run_dir = tmp_path / "dead_engine"
    overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", "trainer.total_episodes=4000"]
    proc = subprocess.Popen(torchrun_argv(overrides), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        metrics_file = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while not (metrics_file.is_file() and metrics_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        registered = json.loads((run_dir / "logs" / "engines.json").read_text())
        victim = next(w for w in registered["workers"] if w["log"].endswith("engine-rank1.log"))
        port = victim["url"].rsplit(":", 1)[1]
        engine_pids = [pid for pid in project_processes(str(small_job["root"]))
                       if f"--port {port} " in (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()]
        assert len(engine_pids) == 1
        killed_at = time.monotonic()
        os.kill(engine_pids[0], signal.SIGKILL)
        output, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    assert time.monotonic() - killed_at < 240, "the job took too long to notice the dead engine"
    assert victim["url"] in output and "engine-rank1.log" in output, output[-4000:]
    assert wait_gone(str(small_job["root"])) == []


@pytest.mark.timeout(300)
def test_generating_on_a_released_engine_stops_the_job_with_one_clear_line(small_job, tmp_path):
    run_dir = tmp_path / "released"
    overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", "trainer.total_episodes=16", "env.num_envs=1",
                                          "env.cls=tests.ppo.releasing_env:ReleaseEnginesEnv",
                                          f"env.kwargs.run_dir={run_dir}"]
    proc = subprocess.run(torchrun_argv(overrides), capture_output=True, text=True, timeout=240, cwd=REPO,
                          start_new_session=True)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if "memory released" in line]
    assert lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "/generate: HTTP 400" in lines[0] and "/resume_memory_occupation" in lines[0]
    assert wait_gone(str(small_job["root"])) == []


@pytest.mark.timeout(600)
def test_a_preparation_and_a_rollout_longer_than_the_collective_timeout_still_train(slow_prepare_run):
    """The first rank of a node builds offline assets before any process group exists; the others
    wait for it (saying whom and what it last reported), never inside a collective that times out. The
    same for what rank 0 alone does later: a rollout longer than the timeout (here rank 0 held at its start;
    before: rank 1 died in the broadcast after it, gloo's 'Timed out waiting 6000ms')."""
    run_dir, output = slow_prepare_run
    assert "[rank 0] test hold: step 1 (rollout) for 9s" in output
    assert "[rank 1] waiting for rank 0 to prepare the offline assets first" in output
    assert re.search(r"\[rank 1\] waiting for rank 0 to prepare the offline assets \(building: step \d of 4\)", output)
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
