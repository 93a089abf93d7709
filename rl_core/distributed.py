"""Process group, device and seeds of one rank: the distributed helpers every job shares."""

from __future__ import annotations

import gc
import os
import random
import stat
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from rl_core.errors import PeerFailed
from workers.net import free_port

T = TypeVar("T")

# One seed per rank, `seed + rank * 100003` (OpenAI lm-human-preferences), so ranks sample differently.
SEED_STRIDE = 100003


def device_for_rank() -> torch.device:
    """``cuda:LOCAL_RANK`` when a GPU is present, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the default process group and return ``(rank, world_size)``.

    Under torchrun the group comes from its environment; a plain ``python -m`` run becomes a
    world of one with the same code path. gloo on CPU, nccl on CUDA. The timeout bounds every
    collective, so a dead rank brings the whole job down instead of hanging it.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}; set trainer.collective_timeout_s")
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if not dist.is_initialized():
        device = device_for_rank()
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                timeout=timedelta(seconds=timeout_s))
        keep_connections_from_children()
    return dist.get_rank(), dist.get_world_size()


def keep_connections_from_children() -> None:
    """Mark this process's sockets (the process group's connections among them) close-on-exec. Helpers
    torch forks and execs (torch_shm_manager, for the CPU weight push) would inherit them otherwise and
    keep them open after this rank exits, so a peer waiting in a collective with it noticed its death
    only when that helper went too (seconds after a stop signal)."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        fd = int(name)
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.set_inheritable(fd, False)
        except OSError:  # closed meanwhile (the listing's own descriptor among them)
            pass


def close_distributed() -> None:
    """Leave the process group while the interpreter is whole. FSDP's modules hold their groups in
    reference cycles, so a group freed only at interpreter exit can take the process down with
    SIGABRT ('terminate called without an active exception', seen on a rank that finished first):
    collect those cycles, then destroy the groups here."""
    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


def local_world_size() -> int:
    """Ranks on this node (torchrun's LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))


def rank_seed(seed: int, rank: int) -> int:
    """The seed of one rank: ``seed + rank * 100003``."""
    return seed + rank * SEED_STRIDE


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _alone() -> bool:
    """No process group, or a world of one: a collective would only copy what this rank has."""
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s object on every rank (pickled over the process group); the object itself in a world of one,
    where pickling a step's 256 trajectories would cost ~20 ms for nothing."""
    if _alone():
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src)
    return holder[0]


def max_over_ranks(value: float) -> float:
    """The largest of every rank's `value` (collective); the value itself without a process group."""
    if _alone():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device_for_rank())  # nccl needs it on the GPU
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def metrics_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Every rank's `metrics` (the same keys on each) as one set (collective): `*_max` the largest,
    `*_min` the smallest, the rest the mean over ranks. The metrics unchanged without a process group."""
    if _alone():
        return metrics
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device_for_rank())
    signs = torch.tensor([-1.0 if k.endswith("_min") else 1.0 for k in keys], dtype=torch.float64, device=values.device)
    extremes, sums = values * signs, values.clone()
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)  # the smallest minimum is minus the largest negated one
    dist.all_reduce(sums)
    world = dist.get_world_size()
    return {key: float(extremes[i] * signs[i]) if key.endswith(("_max", "_min")) else float(sums[i]) / world
            for i, key in enumerate(keys)}


def wait_for_rank0(what: str) -> None:
    """Every other rank waits here, without a timeout, until rank 0 arrives: put before the collective that
    hands out what rank 0 alone computes (the rollout, an evaluation, the prompts it read). That work lasts
    as long as the data and the responses make it (a long-reasoning rollout runs for many minutes); waited
    for inside the collective it would count against trainer.collective_timeout_s and end the job there.
    `what` names this wait, once per job (e.g. with the step). A rank 0 that dies ends the wait too:
    torchrun stops its node's ranks, and the store's server on node 0 goes with it (an error here)."""
    if _alone():
        return
    # The process group's own store: its keys are this run's attempt's. Polled with check, not waited on
    # with store.wait: a TCPStore logs a warning at every timed-out wait.
    store = dist.distributed_c10d._get_default_store()
    key = f"rl_core/rank0_arrived/{what}"
    if dist.get_rank() == 0:
        store.set(key, "1")
        return
    pause = 0.001
    while not store.check([key]):
        time.sleep(pause)  # Python code between checks: a stop signal's handler runs here at once
        pause = min(2 * pause, 0.02)


def on_rank0(fn: Callable[[], T], what: str) -> T | None:
    """Run `fn` on rank 0 only (`what` it does, for `wait_for_rank0`, once per job); if it fails, every
    rank fails at once.

    Rank 0 re-raises its error; the others raise PeerFailed instead of walking into the next
    collective and waiting there until rank 0's exit breaks it. Returns `fn()` on rank 0, None elsewhere.
    """
    if not dist.is_initialized():
        return fn()
    result, error = None, None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as err:  # noqa: BLE001 - re-raised below, after the others are told
            error = err
    wait_for_rank0(what)  # reading a whole dataset may outlast the collective timeout
    failure = broadcast_object(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failure is not None:
        raise PeerFailed(f"rank 0 failed: {failure}")
    return result


def on_every_rank(fn: Callable[[], T]) -> T:
    """Run `fn` on every rank (a check each rank must pass); if any rank fails, all stop together.

    The lowest failing rank re-raises its error (the one line the user sees); the others raise
    PeerFailed, which ends them quietly.
    """
    if not dist.is_initialized():
        return fn()
    result, error = None, None
    try:
        result = fn()
    except Exception as err:  # noqa: BLE001 - re-raised below, once every rank knows
        error = err
    failures = [None] * dist.get_world_size()
    dist.all_gather_object(failures, None if error is None else f"{type(error).__name__}: {error}")
    failed = [rank for rank, failure in enumerate(failures) if failure is not None]
    if failed and dist.get_rank() == failed[0]:
        raise error
    if failed:
        raise PeerFailed(f"rank {failed[0]} failed: {failures[failed[0]]}")
    return result


def prepare_before_process_group(prepare: Callable[[Callable[[str], None]], T], what: str,
                                 report_every_s: float = 15.0, first_report_s: float = 5.0) -> T:
    """`prepare(log)` on every rank before any process group exists; ranks wait for each other without a timeout.

    A first-use build takes minutes, more on a busy machine; a rank waiting for it inside a
    collective would die at the collective timeout. Here local rank 0 of each node prepares first
    (building what is missing, under the builders' own file locks), then the node's other ranks
    (finding it built), and every rank waits until all are done, polling torchrun's key-value
    store (up before any rank starts), and says whom it waits for and what that rank last
    reported: first after `first_report_s` (has the build begun?), then that rank's first line as
    soon as it comes, then news at most every `report_every_s` and a sign of life every four of those.
    A rank whose preparation fails tells the others, which stop with its message.
    Without torchrun's store (a plain `python -m` run) this is just `prepare(print)`.
    """
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world == 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return prepare(print)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0))
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=300))
    prefix = f"rl_core/prepare/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"

    def log(line: str) -> None:
        print(line, flush=True)
        store.set(f"{prefix}/progress/{rank}", line.strip()[-300:])

    def wait_for(ranks: list[int]) -> None:
        keys = [f"{prefix}/done/{r}" for r in ranks]
        last_report, last_said = time.monotonic(), None
        next_report = last_report + first_report_s
        while not store.check(keys):
            now = time.monotonic()
            if now >= next_report:
                pending = [r for r, key in zip(ranks, keys) if not store.check([key])]
                progress = f"{prefix}/progress/{pending[0]}"
                reported = store.check([progress])
                said = store.get(progress).decode() if reported else "no progress reported yet"
                if said != last_said or now - last_report >= 4 * report_every_s:  # news, or a sign of life
                    print(f"[rank {rank}] waiting for rank {pending[0]} to {what} ({said})", flush=True)
                    # Until that rank says something, its first line is news worth printing at once.
                    last_report, last_said, next_report = now, said, now + (report_every_s if reported else 0)
            time.sleep(0.5)
        for key in keys:
            outcome = store.get(key).decode()
            if outcome != "ok":
                raise PeerFailed(outcome)

    node_leader = rank - local_rank  # torchrun numbers a node's ranks contiguously
    if local_rank != 0:
        print(f"[rank {rank}] waiting for rank {node_leader} to {what} first", flush=True)
        wait_for([node_leader])
    try:
        result = prepare(log if local_rank == 0 else (lambda line: None))
    except Exception as err:  # noqa: BLE001 - re-raised below, once the waiting ranks are told
        store.set(f"{prefix}/done/{rank}", f"rank {rank} failed to {what}: {type(err).__name__}: {err}")
        raise
    store.set(f"{prefix}/done/{rank}", "ok")
    wait_for(list(range(world)))
    return result


@dataclass(frozen=True)
class DataParallel:
    """This process's place among the trainers.

    ``sharded=False`` trains alone without any torch.distributed call, even when a process
    group exists (the tiny-RM bootstrap runs on one rank of the PPO job).
    """
    rank: int = 0
    size: int = 1
    sharded: bool = False
    device: torch.device = torch.device("cpu")

    def share(self, items: Sequence[T]) -> tuple[list[T], list[T]]:
        """This rank's contiguous share of ``items`` (the last ranks' may be short or empty), and the same
        padded with repeats of the first item to ``ceil(len / size)``: every rank then runs as many batches,
        so collectives inside them line up. Only the share's results count."""
        per_rank = -(-len(items) // self.size)
        mine = list(items[self.rank * per_rank:(self.rank + 1) * per_rank])
        return mine, mine + [items[0]] * (per_rank - len(mine))

    def sum(self, values: Sequence[float]) -> list[float]:
        """Element-wise sum of ``values`` over ranks."""
        if not self.sharded or self.size == 1:
            return [float(v) for v in values]
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, values: torch.Tensor) -> torch.Tensor:
        """Concatenate equally long 1-D tensors from every rank, in rank order."""
        if not self.sharded or self.size == 1:
            return values
        values = values.to(self.device).contiguous()
        parts = [torch.empty_like(values) for _ in range(self.size)]
        dist.all_gather(parts, values)
        return torch.cat(parts).cpu()

    def concat(self, items: list) -> list:
        """Every rank's ``items`` (picklable), concatenated in rank order, on every rank."""
        if not self.sharded or self.size == 1:
            return list(items)
        parts: list = [None] * self.size
        dist.all_gather_object(parts, list(items))
        return [item for part in parts for item in part]

    def barrier(self) -> None:
        if self.sharded and self.size > 1:
            dist.barrier()
