"""The job lifecycle every job shares leaves nothing behind: however the job inside it ends, the run
directory is free for the next job, and a job that finished closes its process group (a real gloo
group of one)."""

import contextlib
import gc
import os
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from rl_core.config import TrainerConfig
from rl_core.lifecycle import RankLifecycle
from rl_core.run_dir import RunDirInUse, RunDirLock
from rl_core.step_loop import StepHooks, run_steps
from rl_core.stop_signal import StepProgress
from workers.net import free_port


@pytest.fixture
def one_rank(monkeypatch):
    """torchrun's environment for a world of one, undone after the test (the job runs in this process)."""
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    yield
    assert not dist.is_initialized(), "the lifecycle left the process group open"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("error", [RuntimeError("a bug in the job"), SystemExit(130)], ids=["error", "ctrl-c"])
def test_a_job_that_fails_or_stops_frees_the_run_dir_and_leaves_the_process_group_to_its_exit(one_rank, tmp_path, error):
    trainer = TrainerConfig(run_dir=str(tmp_path / "run"), collective_timeout_s=30.0)
    with pytest.raises(type(error)):
        with RankLifecycle(trainer) as job:
            assert (job.rank, job.world_size, dist.get_backend()) == (0, 1, "gloo")
            with pytest.raises(RunDirInUse):  # rank 0 holds the run directory while the job runs
                RunDirLock(trainer.run_dir).acquire()
            job.data_parallel().sum([1.0])
            dist.barrier()
            raise error  # SystemExit is what run_main turns a Ctrl-C into
    # A failing or stopping rank leaves the group to its process's exit (run_main's os._exit): destroying it
    # could wait for a peer stuck in another collective, or let a peer blocked on this rank fail and have
    # torchrun stop this one before it says why. This test's process goes on, so it closes the group.
    assert dist.is_initialized()
    dist.destroy_process_group()
    RunDirLock(trainer.run_dir).acquire().release()  # the next job gets the directory


@pytest.mark.timeout(120)
def test_a_run_dir_in_use_stops_the_job_before_it_starts_and_closes_the_process_group(one_rank, tmp_path):
    other_job = RunDirLock(tmp_path).acquire()
    try:
        with pytest.raises(RunDirInUse, match="is in use by another live job"):
            with RankLifecycle(TrainerConfig(run_dir=str(tmp_path))):
                pytest.fail("the job must not start")
        assert not dist.is_initialized()
    finally:
        other_job.release()


@pytest.mark.timeout(120)
def test_split_cores_gives_torch_this_ranks_share_of_the_cores(one_rank, tmp_path):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with RankLifecycle(TrainerConfig(run_dir=str(tmp_path / "plain"))):
            assert torch.get_num_threads() == 1  # the SFT, DPO and reward-model jobs keep torch's own count
        with RankLifecycle(TrainerConfig(run_dir=str(tmp_path / "split")), split_cores=True) as job:
            assert torch.get_num_threads() == job.cpu_threads() == len(os.sched_getaffinity(0))  # one rank per node
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_ppo_rank_leaves_cores_to_what_runs_beside_its_engine(one_rank, tmp_path, mode):
    from rl_core.ppo.config import PPOConfig
    from rl_core.ppo.runtime import PPORuntime

    cfg = PPOConfig()
    cfg.trainer.run_dir, cfg.trainer.mode = str(tmp_path / mode), mode
    before = torch.get_num_threads()
    try:
        with PPORuntime(cfg) as rt:  # no engine starts here: the split is decided with the process group
            cores = rt.cpu_threads()
            assert torch.get_num_threads() == rt.trainer_threads()
            assert rt.trainer_threads() == cores  # the engine decodes for a part of the step only
            if mode == "sync":  # all but the core its HTTP front end, the router and the client use meanwhile
                assert rt.engine_threads() == max(1, cores - 1)
            else:  # beside a trainer that computes at the same time
                assert rt.engine_threads() == max(1, cores // 2)
            # the next step's forward passes run while the async engine decodes: on the cores it leaves
            with rt.threads_beside_decoding():
                inside = torch.get_num_threads()
            assert inside == (cores if mode == "sync" else max(1, cores - rt.engine_threads()))
            assert torch.get_num_threads() == rt.trainer_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.timeout(120)
def test_a_ppo_rank_on_a_gpu_keeps_one_cpu_thread_for_its_bookkeeping(one_rank, tmp_path, monkeypatch):
    """A GPU rank's CPU tensors are small (layouts, advantages): with torch's default threads each op waited at an
    OpenMP barrier for a thread sharing a core with SGLang's polling scheduler (an H200: 6-8 ms an `index`). There
    is no GPU here, so the rank is told it has one; nothing in the lifecycle touches the device itself."""
    import rl_core.lifecycle
    from rl_core.ppo.config import PPOConfig
    from rl_core.ppo.runtime import PPORuntime

    monkeypatch.setattr(rl_core.lifecycle, "device_for_rank", lambda: torch.device("cuda", 0))
    cfg = PPOConfig()
    cfg.trainer.run_dir = str(tmp_path / "gpu")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with PPORuntime(cfg) as rt:
            assert rt.device.type == "cuda" and torch.get_num_threads() == rt.trainer_threads() == 1
    finally:
        torch.set_num_threads(before)


class _Cycle:
    """An object in a reference cycle: only Python's collector frees it."""

    def __init__(self):
        self.me = self


@pytest.mark.parametrize("fails", [False, True], ids=["finished", "failed"])
def test_the_steps_run_with_the_setup_objects_out_of_full_collections(tmp_path, fails):
    setup = {"cycle": _Cycle()}  # built before the first step, held by the job
    cycle = weakref.ref(setup["cycle"])
    freed_in_a_step = []

    def one_step(step):
        setup.pop("cycle", None)  # the job drops it during a step
        gc.collect()  # a full collection: it does not walk what existed before the steps
        freed_in_a_step.append(cycle() is None)
        if fails:
            raise RuntimeError("a failing step")
        return {}

    steps = StepHooks(one_step=one_step, log=lambda step, metrics: None, save=lambda step: None)
    trainer = SimpleNamespace(profile_steps=[], run_dir=str(tmp_path), save_every=0)
    with pytest.raises(RuntimeError) if fails else contextlib.nullcontext():
        run_steps(steps, 0, 2, trainer, 0, torch.device("cpu"), StepProgress())
    assert freed_in_a_step == [False] * (1 if fails else 2)
    # However the loop ended, the collector has everything back (a job's clean-up collects FSDP's cycles).
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert cycle() is None
