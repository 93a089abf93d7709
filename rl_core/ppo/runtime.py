"""Everything a rank owns besides its models: the job lifecycle (process group, run directory),
its engine, the router (rank 0), the rollout service (rank 0), and the clean-up that leaves no
process behind on any exit. How its cores are split is `threads.py`'s; the other nodes' watch `node_watch.py`'s.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from types import SimpleNamespace

import torch.distributed as dist

from rl_core.distributed import on_rank0, rank_seed, wait_for_rank0
from rl_core.lifecycle import RankLifecycle
from rl_core.ppo.config import PPOConfig, engine_dtype
from rl_core.ppo.node_watch import NodeWatch, check_reachable
from rl_core.ppo.threads import ThreadPolicy
from rl_core.rollout.process import RolloutProcess, ServedVersion
from rl_core.rollout.rollout import RolloutSettings
from rl_core.rollout.service import build_service
from workers.engines.embedded.forked import EngineFork
from workers.engines.rank_engine import RankEngine
from workers.engines.spec import EngineSpec, is_vision_language
from workers.net import http_problem, node_address
from workers.procs import ManagedProcesses

ENGINE_START_TIMEOUT_S = 300.0


class PPORuntime(ThreadPolicy, RankLifecycle):
    """Context manager for one rank's processes and connections; `__exit__` stops them all.

    The process group, the CPU split between trainer and engine (its policy: `ThreadPolicy`) and the run
    directory's lock are the shared job lifecycle's; this adds the engines, the router and the rollout service."""

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

    def __enter__(self) -> "PPORuntime":
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
        # A vision-language policy's processor is loaded where the rollout runs, from its path (a path pickles).
        vision_path = self.cfg.model.path if is_vision_language(self.cfg.model.path) else None
        args = (SimpleNamespace(**vars(self.cfg.env)), SimpleNamespace(**vars(self.cfg.reward)), self.router_url,
                tokenizer, settings, vision_path)
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


