"""Everything a rank owns besides its models: the job lifecycle (process group, run directory),
its engine, the router (rank 0), the rollout service (rank 0), and the clean-up that leaves no
process behind on any exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from types import SimpleNamespace
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from rl_core.distributed import on_rank0, rank_seed, wait_for_rank0
from rl_core.lifecycle import JobLifecycle, torch_threads
from rl_core.ppo.config import PPOConfig, engine_dtype
from rl_core.rollout.process import RolloutProcess, ServedVersion
from rl_core.rollout.rollout import RolloutSettings
from rl_core.rollout.service import build_service
from workers.engines.embedded.forked import EngineFork
from workers.engines.rank_engine import EngineSpec, RankEngine
from workers.net import http_problem, node_address
from workers.procs import ManagedProcesses, ProcessStartError, stop_this_process

ENGINE_START_TIMEOUT_S = 300.0


class JobRuntime(JobLifecycle):
    """Context manager for one rank's processes and connections; `__exit__` stops them all.

    The process group, the CPU split between trainer and engine and the run directory's lock are
    the shared job lifecycle's; this adds the engines, the router and the rollout service."""

    def __init__(self, cfg: PPOConfig, engine_fork: EngineFork | None = None):
        """`engine_fork`: the entry point's, which an embedded engine runs in (else it starts as a command)."""
        # Trainer and engine share the cores of this node: split them instead of oversubscribing.
        super().__init__(cfg.trainer, split_cores=True)
        self.cfg = cfg
        self.procs = ManagedProcesses()
        self.engine: RankEngine | None = None
        self.engine_urls: list[str] = []
        self.engine_logs: dict[str, str] = {}
        self.engine_places: dict[str, str] = {}  # url -> "rank R on node N, host"
        self.router_url: str | None = None
        self.served_version = ServedVersion()  # the weights' version the engines serve (the rollout reads it)
        # Sync mode: release engine memory while training (the memory plan's decision under rollout.release_memory).
        self.release_each_step = True
        self.service = None
        self.node_watch = None
        self.engine_fork = engine_fork

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "JobRuntime":
        try:
            if self.engine_fork is not None and self.cfg.rollout.engine != "embedded":
                self.engine_fork.close()  # SGLang starts as its own command
                self.engine_fork = None
            super().__enter__()
            self.log_dir = self.run_dir / "logs"
            self.log_dir.mkdir(parents=True, exist_ok=True)
            if self.rank == 0 and self.cfg.trainer.mode == "async" and self.cfg.async_.rollout_process:
                # Async mode: the rollout runs beside the trainer, in a process of its own so that their Python
                # does not take turns on one GIL; started now, its imports overlap the engines' start.
                self.service = RolloutProcess(build_service, self.served_version)
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.stop_node_watch()
        try:
            if self.service is not None:  # the envs, reward workers and MCP servers with it
                self.service.close()
            if self.engine is not None:
                self.engine.close()
            if self.engine_fork is not None:  # if it never became the engine, it exits now
                self.engine_fork.close()
        finally:
            reason = "the job finished" if exc_type is None else f"the job is stopping ({exc_type.__name__})"
            self.procs.stop_all(reason)
            super().__exit__(exc_type, exc, tb)  # the process group, then the run directory

    # ------------------------------------------------------------------ engines and router

    @property
    def nnodes(self) -> int:
        return self.world_size // max(self.local_world_size, 1)

    def bind_host(self) -> str:
        """Loopback on one node; on several, this node's address (rollout.multi_node_host, or the one
        that reaches node 0), so the router on node 0 reaches every engine."""
        if self.nnodes <= 1:
            return "127.0.0.1"
        return node_address(self.cfg.rollout.multi_node_host, os.environ["MASTER_ADDR"],
                            int(os.environ["MASTER_PORT"]))

    def engine_threads(self) -> int:
        """An embedded engine's torch threads. Sync mode: all of this rank's cores but one, which the engine's HTTP
        front end, the router and rank 0's rollout client need while it decodes (with every core, each of its
        parallel ops waited at an OpenMP barrier for a thread those had descheduled: the gpu86m shape on 2 cores,
        alternated runs, a 256 x 48-token busy period 0.36-0.37 s with 2 threads, 0.29 s with 1). Async mode:
        half of them, since it decodes while the trainer computes on every core (2 + 2 threads on 2 cores made
        each wait on the other's: 2.5-2.7 s a step against 2.2-2.4 s with the engine on 1)."""
        cores = self.cpu_threads()
        return max(1, cores - 1) if self.cfg.trainer.mode == "sync" else max(1, cores // 2)

    def trainer_threads(self) -> int:
        """The trainer's torch threads: all of this rank's cores, in async mode too: the engine decodes for part of
        the step only (one batch per step, 0.3 s of a 1.1 s step for the gpu86m shape on 2 cores), and a trainer
        on the cores it leaves would leave one idle the rest of the time (alternated runs: 1.01-1.14 s a step
        with 2 trainer threads beside the engine's 1, 1.22-1.24 s with 1).

        On a GPU, one: the trainer's CPU tensors are bookkeeping (layouts, advantages), and with more threads
        each small op waits at an OpenMP barrier for a thread that shares a core with a busy neighbour, such as
        SGLang's scheduler, which polls while idle (one H200, gpu86m: torch's 16 threads made each CPU
        `index` 6-8 ms, 0.38 s of a 0.59 s reference forward)."""
        return self.cpu_threads() if self.device.type == "cpu" else 1

    @contextlib.contextmanager
    def threads_beside_decoding(self) -> Iterator[None]:
        """For the trainer's work that overlaps its engine's decoding: in async mode on CPU the engine starts on the
        next batch when a push ends, so the next step's forward passes run beside it; on the cores it leaves, its
        parallel ops wait on no descheduled thread (the gpu86m shape on 2 cores, alternated runs: those passes
        0.57-0.59 s with 2 threads, 0.45-0.47 s with 1)."""
        if self.device.type != "cpu" or self.cfg.trainer.mode == "sync":
            yield
            return
        with torch_threads(max(1, self.cpu_threads() - self.engine_threads())):
            yield

    def start_engines(self, policy_path: str, pauses_in_place: bool, context_length: int | None = None,
                      kv_tokens: int | None = None) -> None:
        """Each rank launches its engine; rank 0 starts the router and registers every engine.

        `pauses_in_place`: requests stay in the engine across a weight push (async partial rollout).
        `context_length`: the policy's, which every engine serves. `kv_tokens`: the KV pool SGLang gets
        (the memory plan's) unless rollout.sglang_args sets max_total_tokens."""
        ro = self.cfg.rollout
        sglang_args = dict(ro.sglang_args)
        if pauses_in_place and ro.engine == "sglang":
            # Paused requests keep running across a push, so the cache cannot be flushed then; without
            # a prefix cache no entry computed under old weights outlives the push.
            sglang_args.setdefault("disable_radix_cache", True)
        gpus = None
        if self.device.type == "cuda":
            gpus = tuple(range(self.local_rank * ro.tp_size, (self.local_rank + 1) * ro.tp_size))
        spec = EngineSpec(kind=ro.engine, model_path=policy_path, dtype=engine_dtype(self.cfg),
                          device=str(self.device), host=self.bind_host(),
                          seed=rank_seed(self.cfg.trainer.seed, self.rank),
                          max_batch_size=ro.engine_max_batch_size, num_threads=self.engine_threads(),
                          tp_size=ro.tp_size, mem_fraction_static=ro.mem_fraction_static,
                          sglang_args=sglang_args, gpu_ids=gpus, sglang_python=ro.sglang_python,
                          context_length=context_length, kv_tokens=kv_tokens)
        log_path = self.log_dir / f"engine-rank{self.rank}.log"
        deadline = ENGINE_START_TIMEOUT_S * (2 if ro.engine == "sglang" else 1)
        self.engine = RankEngine.launch(spec, log_path, self.procs, deadline, ro.weight_bucket_mb << 20,
                                        timeout_s=ro.engine_timeout_s, probe_tolerance=ro.weight_check_tolerance,
                                        fork=self.engine_fork)  # the embedded engine runs in it
        gathered = [None] * self.world_size
        node = {"node": self.rank // max(self.local_world_size, 1), "host": socket.gethostname()}
        dist.all_gather_object(gathered, (self.engine.url, str(log_path), node))
        self.engine_urls = [url for url, _, _ in gathered]
        self.engine_logs = {url: log for url, log, _ in gathered}
        self.engine_places = {url: f"rank {rank} on node {where['node']}, {where['host']}"
                              for rank, (url, _, where) in enumerate(gathered)}
        if self.nnodes > 1:  # rollout traffic crosses the network: every engine must answer node 0 first
            on_rank0(lambda: check_reachable(gathered), "reach every engine")
        if self.rank == 0:
            from workers.router import RouterSettings, launch_router

            # Only this rank talks to the router, so it stays on loopback; it reaches out to the engines.
            router = launch_router("127.0.0.1", None, self.engine_urls, log_path=self.log_dir / "router.log",
                                   settings=RouterSettings(policy=ro.router_policy), processes=self.procs)
            self.router_url = router.url
            # What the router actually registered, and where each engine runs, for whoever debugs a launch.
            where = {url: {"rank": rank, **node, "log": log} for rank, (url, log, node) in enumerate(gathered)}
            workers = [{"url": w.get("url"), "healthy": w.get("is_healthy"), **where.get(w.get("url"), {})}
                       for w in router.workers()]
            (self.log_dir / "engines.json").write_text(json.dumps({"router": self.router_url, "workers": workers},
                                                                  indent=1))
            if self.nnodes > 1:
                for url, info in where.items():
                    print(f"engine of rank {info['rank']} on node {info['node']} ({info['host']}): {url}", flush=True)
        wait_for_rank0("start the router")  # rank 0's alone, so not inside the barrier's timeout
        dist.barrier()
        if self.nnodes > 1:  # a node whose link is cut closes no connection: notice it anyway
            self.node_watch = NodeWatch(self.rank, node["node"], gathered, timeout_s=ro.node_timeout_s)

    def stop_node_watch(self) -> None:
        """From here on the other nodes may finish and stop their engines: that is no lost node."""
        if self.node_watch is not None:
            self.node_watch.stop()

    def dead_engines(self) -> list[str]:
        """Router and engines (with their log files) that no longer answer: the usual cause of a rollout error."""
        def answers(url: str) -> bool:
            return http_problem(f"{url}/health", timeout_s=5) is None

        def exit_codes() -> dict[str, int]:
            return {name: code for name, code, _ in self.procs.exited()}

        dead = []
        router_down = self.router_url is not None and not answers(self.router_url)
        codes = exit_codes()
        # A killed router closes its sockets a moment before it can be reaped: give its exit code a moment.
        give_up = time.monotonic() + 2.0
        while router_down and "sglang-router" not in codes and time.monotonic() < give_up:
            time.sleep(0.05)
            codes = exit_codes()
        if router_down or "sglang-router" in codes:
            how = f"exited with code {codes['sglang-router']}" if "sglang-router" in codes else "stopped answering"
            dead.append(f"sglang-router {self.router_url} {how} (log {self.log_dir / 'router.log'})")
        dead += [f"engine {url} ({self.engine_places.get(url, 'this node')}) stopped answering "
                 f"(log {self.engine_logs.get(url)})" for url in self.engine_urls if not answers(url)]
        return dead

    def start_rollout_service(self, tokenizer, settings: RolloutSettings):
        """Rank 0: the envs, the reward functions and the rollout loop that sends `/generate` to the router;
        in the rollout process when there is one, else in a thread of this one."""
        # The sections as plain attributes: unpickling the config's classes would import torch into the
        # rollout process, which needs none of it (seconds of start-up and 200 MB).
        args = (SimpleNamespace(**vars(self.cfg.env)), SimpleNamespace(**vars(self.cfg.reward)), self.router_url,
                tokenizer, settings)
        if isinstance(self.service, RolloutProcess):
            self.service.start(*args)
        else:
            self.service = build_service(*args, self.served_version)
        return self.service

    def release_engine_memory(self) -> float:
        """Every engine frees its KV cache and weights while the trainer runs (it must be idle: sync mode),
        when `release_each_step`. Returns the seconds it took (0 when it does not release).

        The same call on CPU as on GPU, so a CI run with rollout.release_memory=always exercises the GPU
        control flow.
        """
        return self.engine.release_memory() if self.release_each_step else 0.0

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                     probe_ids: list[int], trainer_logprobs: list[float], pause_in_place: bool) -> dict[str, float]:
        """Every rank pushes its full weights into its engine, checked by version and probe logprobs
        (`RankEngine.push`). Collective: the tensors are gathered from every rank."""
        dist.barrier()
        stats = self.engine.push(named_tensors, version, probe_ids, trainer_logprobs, pause_in_place)
        self.served_version.set(version)
        dist.barrier()
        return stats


def check_reachable(engines: list[tuple[str, str, dict]], timeout_s: float = 10.0) -> None:
    """Every engine answers /health from here (node 0, where the router runs), or one line names it."""
    for rank, (url, _, node) in enumerate(engines):
        problem = http_problem(f"{url}/health", timeout_s)
        if problem is None:
            continue
        raise ProcessStartError(f"the engine of rank {rank} on node {node['node']} ({node['host']}) at {url} cannot "
                                f"be reached from node 0, where the router runs ({problem}); let node 0 reach that "
                                "node's TCP ports (engines take free ports) or set rollout.multi_node_host to an "
                                "address node 0 can reach")


class NodeWatch:
    """Several nodes only: notice a lost node even when no connection says so.

    A killed node closes its sockets and the next collective fails at once; a node whose link is
    cut closes nothing, and every rank would wait out the collective timeout. So each rank asks
    one engine of every other node for /health (answered even while paused or released) six times per
    `timeout_s` (rollout.node_timeout_s); when a node has not answered `misses` times in a row over at
    least `timeout_s`, this rank stops, naming it. Misses are counted, not only timed, so a rank starved
    of CPU for a while does not mistake its own silence for the other node's.
    """

    def __init__(self, rank: int, my_node: int, engines: list[tuple[str, str, dict]], timeout_s: float = 30.0,
                 misses: int = 3):
        self.rank, self.interval_s, self.timeout_s, self.misses = rank, timeout_s / 6, timeout_s, misses
        self.watched: dict[int, tuple[str, str]] = {}
        for url, _, node in engines:
            if node["node"] != my_node:
                self.watched.setdefault(node["node"], (url, node["host"]))
        self.stopped = threading.Event()
        threading.Thread(target=self._watch, name="node-watch", daemon=True).start()

    def stop(self) -> None:
        self.stopped.set()

    def _watch(self) -> None:
        missed: dict[int, list[float]] = {n: [] for n in self.watched}
        while not self.stopped.wait(self.interval_s):
            for number, (url, host) in self.watched.items():
                if http_problem(f"{url}/health", timeout_s=self.interval_s) is None:
                    missed[number] = []
                    continue
                missed[number].append(time.monotonic())
                times = missed[number]
                if len(times) >= self.misses and times[-1] - times[0] >= self.timeout_s - self.interval_s \
                        and not self.stopped.is_set():
                    stop_this_process(f"[rank {self.rank}] stopped: node {number} ({host}) stopped answering "
                                      f"({url} silent for {time.monotonic() - times[0] + self.interval_s:.0f}s): it "
                                      "died or lost its link; see its log", grace_s=10.0)
                    return
