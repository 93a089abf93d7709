"""One job's life on one rank, the same for every job (SFT, DPO, reward model, PPO).

`with RankLifecycle(cfg.trainer) as job:` joins the process group (its timeout from
`trainer.collective_timeout_s`), optionally gives this rank its share of the node's cores,
takes the run directory's lock on rank 0, and on every exit (success, error, Ctrl-C) frees the
run directory and leaves the process group (a stop signal's exit leaves it by ending the process). Reading the config is the caller's job; the PPO
job's `PPORuntime` adds its engines, router and rollout service on top of this.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import torch

from rl_core.config import TrainerConfig
from rl_core.distributed import (DataParallel, close_distributed, device_for_rank, init_distributed,
                                 local_world_size, on_rank0)
from rl_core.run_dir import RunDirLock


@contextlib.contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Temporarily run torch with `num_threads` intra-op threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class RankLifecycle:
    """Context manager for this rank's process group and the run directory's lock.

    `split_cores`: set torch's threads to `trainer_threads()` (on CPU, this rank's share of the node's
    cores), for jobs whose ranks share the node with other busy processes (the PPO job's engines);
    otherwise torch keeps its own thread count.
    """

    def __init__(self, trainer: TrainerConfig, split_cores: bool = False):
        self.trainer = trainer
        self.split_cores = split_cores
        self.run_dir = Path(trainer.run_dir)
        self.run_dir_lock: RunDirLock | None = None

    def __enter__(self) -> "RankLifecycle":
        self.rank, self.world_size = init_distributed(timeout_s=self.trainer.collective_timeout_s)
        try:
            self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
            self.local_world_size = local_world_size()
            self.device = device_for_rank()
            if self.split_cores:
                torch.set_num_threads(self.trainer_threads())
            # One live job per run directory; every rank stops at once if another job holds it.
            self.run_dir_lock = on_rank0(lambda: RunDirLock(self.run_dir).acquire(), "lock the run directory")
        except BaseException:
            self.close()  # every rank raises here together (on_rank0): nothing is in flight
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(leave_group=exc_type is None)

    def close(self, leave_group: bool = True) -> None:
        """Leave the process group, then free the run directory; a second call does nothing.

        `leave_group=False` (the job failed or a stop signal ends it; run_main then says the one line
        and ends the process with os._exit): the group is left to the process's exit, which closes its
        connections, so peers blocked on this rank fail at once. Destroying it here would be too early
        twice over: it waits for collectives in flight, which a peer interrupted in another collective
        never completes (seen: a rank hung in the clean-up after a SIGTERM mid-checkpoint), and a peer
        blocked on this rank would fail, exit and have torchrun SIGTERM this rank before it said its
        error (seen in CI: the root cause never printed)."""
        if leave_group:
            close_distributed()
        if self.run_dir_lock is not None:
            self.run_dir_lock.release()
            self.run_dir_lock = None

    def cpu_threads(self) -> int:
        """This rank's share of the cores this process may run on (taskset, cgroup cpusets), not of
        every core of the machine: the node's ranks split them instead of oversubscribing them."""
        return max(1, len(os.sched_getaffinity(0)) // self.local_world_size)

    def trainer_threads(self) -> int:
        """This rank's torch threads under `split_cores`: all of its share (a job whose other processes compute
        at other times)."""
        return self.cpu_threads()

    def data_parallel(self) -> DataParallel:
        """This rank among the trainers, sharded over the whole process group."""
        return DataParallel(self.rank, self.world_size, sharded=True, device=self.device)
