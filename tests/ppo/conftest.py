"""What the PPO job tests share: the small job's assets and settings."""

import pytest


@pytest.fixture(scope="session")
def small_job(tmp_path_factory):
    """Small offline assets and a randomly initialised reward model (the plumbing, not the learning): built
    once for every PPO job test (about 8 s each time); the jobs only read them."""
    from offline.assets import ensure_tiny_assets
    from workers.loading import init_reward_model, load_tokenizer

    root = tmp_path_factory.mktemp("train_assets")
    paths = ensure_tiny_assets(root=root, small=True, log=lambda *_: None)
    tokenizer = load_tokenizer(str(paths.model_dir))
    rm_dir = root / "rm"
    init_reward_model(str(paths.model_dir), pad_token_id=tokenizer.pad_token_id).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    return {"root": root, "overrides": [
        f"model.path={paths.model_dir}", f"reward.model_path={rm_dir}", f"data.train_path={paths.train_prompts}",
        "data.max_prompt_length=12", "rollout.response_length=6", "reward.truncate_after=2",
        "algorithm.batch_size=8", "algorithm.noptepochs=2", "algorithm.lr=3e-4", "trainer.progress=false",
        "env.num_envs=4"]}


# 3 sync steps, a checkpoint each; always: the GPU's release/resume control flow, which a plan that fits
# (this machine) would skip.
SYNC_RUN = ("trainer.total_episodes=24", "trainer.save_every=1", "rollout.release_memory=always")
# 4 async steps, one batch stale at most, two queued, a checkpoint each (all kept).
ASYNC_RUN = ("trainer.total_episodes=32", "trainer.mode=async", "async.max_staleness=1", "async.queue_batches=2",
             "trainer.save_every=1", "trainer.keep_last=0")
# Steps 2 and 3 of both runs are profiled (tests/ppo/test_profile.py reads the traces): a profiled step computes
# the same numbers, so the other tests read these runs as if unprofiled.
PROFILED = "trainer.profile_steps=[2,3]"


@pytest.fixture(scope="session")
def sync_run(small_job, tmp_path_factory):
    """One uninterrupted sync run: (run directory, its output). Read by the protocol and profile tests, and as
    the resume test's reference."""
    from tests.ppo.test_job import run_job

    run_dir = tmp_path_factory.mktemp("sync") / "run"
    return run_dir, run_job(small_job, run_dir, *SYNC_RUN, PROFILED)


@pytest.fixture(scope="session")
def async_run(small_job, tmp_path_factory):
    """One async run without partial rollout: (run directory, its output). Read by the staleness and profile
    tests."""
    from tests.ppo.test_job import run_job

    run_dir = tmp_path_factory.mktemp("async") / "run"
    return run_dir, run_job(small_job, run_dir, *ASYNC_RUN, "async.partial_rollout=false", PROFILED)


@pytest.fixture(scope="session")
def slow_prepare_run(small_job, tmp_path_factory):
    """2 sync steps whose preparation (10 s on rank 0, past the waiting rank's first report at 5 s) and first
    rollout (rank 0 held 9 s at its start) outlast the collective timeout (6 s), with pi_old recomputed by the
    trainer, on the default memory plan: one job for the two tests after it in test_job.py and
    test_memory_job.py's plan that fits. (run directory, its output)"""
    import sys

    from rl_core.stop_signal import TEST_HOLD_ENV
    from tests.jobs import run_to_end
    from tests.ppo.test_job import REPO

    run_dir = tmp_path_factory.mktemp("slow_prepare") / "run"
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
            "-m", "tests.ppo.slow_prepare", "10", "--config", "ppo_sentiment.yaml", *small_job["overrides"],
            f"trainer.run_dir={run_dir}", "trainer.total_episodes=16", "trainer.collective_timeout_s=6",
            "algorithm.old_logprobs=trainer"]
    return run_dir, run_to_end(argv, timeout=500, cwd=REPO,  # a timeout kills torchrun and its ranks
                               env={TEST_HOLD_ENV: "0:1:rollout:9"})  # rank 1 waits 9 s for step 1's rollout


@pytest.fixture(scope="session")
def arithmetic_job(tmp_path_factory):
    """The arithmetic GRPO recipe's small offline assets (policy, problems, held-out problems) and settings."""
    from offline.arithmetic import ensure_arithmetic_assets

    root = tmp_path_factory.mktemp("arithmetic_assets")
    paths = ensure_arithmetic_assets(root, small=True, log=lambda *_: None)
    return {"root": root, "overrides": [
        f"model.path={paths.model_dir}", f"data.train_path={paths.train_file}", f"data.eval_path={paths.eval_file}",
        "data.max_prompt_length=80", "rollout.response_length=12", "algorithm.batch_size=16",
        "algorithm.group_size=4", "algorithm.nminibatches=2", "env.num_envs=8", "trainer.progress=false",
        "eval.max_prompts=12"]}


@pytest.fixture(scope="session")
def arithmetic_run(arithmetic_job, tmp_path_factory):
    """3 steps of the arithmetic GRPO recipe with evaluations at step 0, every 2 steps and the end, gradient
    checkpointing on: (run directory, its output). Read by the recipe's test and the metrics reference's."""
    from tests.ppo.test_job import run_job

    run_dir = tmp_path_factory.mktemp("arithmetic") / "run"
    return run_dir, run_job(arithmetic_job, run_dir, "trainer.total_episodes=48", "eval.every=2",
                            "model.gradient_checkpointing=true", timeout=480, config="grpo_arithmetic.yaml")


@pytest.fixture(scope="module")
def process_group(tmp_path_factory):
    """A gloo group of one rank for the tests that build a rank's models in this process (FSDP2 needs one)."""
    import torch.distributed as dist

    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
