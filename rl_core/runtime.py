"""Everything a rank owns besides its models: process group, its engine, the router (rank 0),
assets, and the clean-up that leaves no process behind on any exit.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rl_core.config import JobConfig
from workers.engines.client import EngineClient, EngineError
from workers.engines.weights import sync_weights
from workers.fsdp import device_for_rank, init_distributed
from workers.procs import ManagedProcesses, free_port, wait_http_ok

ENGINE_START_TIMEOUT_S = 300.0


def _single_process_env() -> None:
    """`python -m rl_core.train` without torchrun: a world of one, same code path."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


class JobRuntime:
    """Context manager for one rank's processes and connections; `__exit__` stops them all."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.procs = ManagedProcesses()
        self.engine_url: str | None = None
        self.engine_urls: list[str] = []
        self.router_url: str | None = None
        self.engine_version = 0
        self.tokenizer = None
        self.policy_path = self.reward_path = self.prompts_path = None
        self.service = None
        self._loop = asyncio.new_event_loop()  # for this rank's own engine calls (sync, release/resume)

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "JobRuntime":
        _single_process_env()
        self.rank, self.world_size = init_distributed(timeout_s=self.cfg.trainer.collective_timeout_s)
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))
        self.device = device_for_rank()
        if self.device.type == "cpu":
            # Trainer and engine share the cores of this node: split them instead of oversubscribing.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.local_world_size))
        self.run_dir = Path(self.cfg.trainer.run_dir)
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self.service is not None:
                self.service.close()
        finally:
            self.procs.stop_all()
            self._loop.close()
            if dist.is_initialized():
                dist.destroy_process_group()
        if exc_type is not None and not issubclass(exc_type, (SystemExit, KeyboardInterrupt)):
            print(f"[rank {self.getattr_rank()}] job failed: {exc_type.__name__}: {exc}", file=sys.stderr)

    def getattr_rank(self) -> int:
        return getattr(self, "rank", -1)

    def run(self, coro, timeout: float | None = None):
        return self._loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def broadcast(self, obj):
        """Rank 0's object on every rank (pickled over the process group)."""
        holder = [obj]
        dist.broadcast_object_list(holder, src=0)
        return holder[0]

    # ------------------------------------------------------------------ engines and router

    def bind_host(self) -> str:
        """Loopback unless several nodes must reach each other."""
        nnodes = self.world_size // max(self.local_world_size, 1)
        if nnodes <= 1:
            return "127.0.0.1"
        return self.cfg.rollout.multi_node_host or socket.gethostbyname(socket.gethostname())

    def start_engines(self, policy_path: str) -> None:
        """Each rank launches its engine; rank 0 starts the router and registers every engine."""
        cfg = self.cfg.rollout
        host = self.bind_host()
        port = free_port(host)
        name = f"engine-rank{self.rank}"
        log_path = self.log_dir / f"{name}.log"
        if cfg.engine == "embedded":
            threads = max(1, (os.cpu_count() or 1) // self.local_world_size)
            argv = [sys.executable, "-m", "workers.engines.embedded", "--model-path", policy_path,
                    "--host", host, "--port", str(port), "--device", str(self.device),
                    "--dtype", self.cfg.model.dtype, "--max-batch-size", str(cfg.engine_max_batch_size),
                    "--num-threads", str(threads), "--seed", str(self.cfg.seed + self.rank * 100003)]
            proc = self.procs.start(name, argv, log_path)
            self.engine_url = f"http://{host}:{port}"
            wait_http_ok(f"{self.engine_url}/health", ENGINE_START_TIMEOUT_S, proc=proc, log_path=log_path, name=name)
        else:
            from workers.engines.sglang_engine import SGLangEngine

            self.sglang = SGLangEngine(policy_path, log_path, host=host, port=port, tp_size=cfg.tp_size,
                                       mem_fraction_static=cfg.mem_fraction_static, base_gpu_id=self.local_rank,
                                       dtype=self.cfg.model.dtype, processes=self.procs)
            self.sglang.start(ENGINE_START_TIMEOUT_S * 2)
            self.engine_url = self.sglang.url
        self.engine_logs = [None] * self.world_size
        gathered = [None] * self.world_size
        dist.all_gather_object(gathered, (self.engine_url, str(log_path)))
        self.engine_urls = [url for url, _ in gathered]
        self.engine_logs = {url: log for url, log in gathered}
        if self.rank == 0:
            from workers.router import launch_router

            self.router = launch_router(host, None, self.engine_urls, log_path=self.log_dir / "router.log",
                                        policy=cfg.router_policy, processes=self.procs)
            self.router_url = self.router.url
            # What the router actually registered, for whoever debugs a multi-node launch.
            workers = [{"url": w.get("url"), "healthy": w.get("is_healthy"), "log": self.engine_logs.get(w.get("url"))}
                       for w in self.router.workers()]
            (self.log_dir / "engines.json").write_text(json.dumps({"router": self.router_url, "workers": workers}, indent=1))
        dist.barrier()

    def dead_engines(self) -> list[str]:
        """Engines (with their log files) that no longer answer /health: the usual cause of a rollout error."""
        import urllib.request

        dead = []
        for url in self.engine_urls:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        continue
            except OSError:
                pass
            dead.append(f"engine {url} (log {self.engine_logs.get(url)})")
        return dead

    def start_rollout_service(self):
        from envs.base import make_env_factory, make_executor
        from rl_core.rollout_service import RolloutService

        cfg, ro = self.cfg, self.cfg.rollout
        env_kwargs = dict(cfg.env.kwargs)
        executor = make_executor(cfg.env.thread_pool_size)
        sampling = {"max_new_tokens": ro.response_length, "temperature": ro.temperature, "top_p": ro.top_p,
                    "top_k": ro.top_k if ro.top_k > 0 else -1, "ignore_eos": ro.ignore_eos}
        self.service = RolloutService(
            router_url=self.router_url, tokenizer=self.tokenizer,
            env_factory=make_env_factory(cfg.env.cls, env_kwargs, executor), num_envs=cfg.env.num_envs,
            step_timeout_s=cfg.env.step_timeout_s, max_failed_ratio=cfg.env.max_failed_ratio,
            sampling_params=sampling, max_turns=ro.max_turns, concurrency=ro.concurrency,
            max_total_tokens=self.max_positions, timeout_s=ro.engine_timeout_s, progress=cfg.trainer.progress)
        return self.service

    def sync_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> dict:
        """Push full weights into this rank's engine and verify version + checksum (fail fast)."""

        async def push():
            async with EngineClient(self.engine_url, timeout_s=self.cfg.rollout.engine_timeout_s) as client:
                if self.cfg.trainer.mode == "async" and self.cfg.async_.partial_rollout:
                    await client.pause("in_place")  # in-flight requests continue on the new weights
                    try:
                        return await sync_weights(client, state_dict, str(version))
                    finally:
                        await client.resume()
                if self.cfg.trainer.mode == "async":
                    await wait_idle(client, self.cfg.rollout.engine_timeout_s)  # requests finish on the old weights
                return await sync_weights(client, state_dict, str(version))

        holding = (self.rank == 0 and self.service is not None and self.cfg.trainer.mode == "async"
                   and not self.cfg.async_.partial_rollout)
        if holding:
            self.service.hold()  # no new requests until every engine has its new weights
        dist.barrier()
        try:
            timings = self.run(push(), self.cfg.rollout.engine_timeout_s)
        except (EngineError, asyncio.TimeoutError) as err:
            raise RuntimeError(f"weight sync into engine {self.engine_url} failed ({err}); its log: "
                               f"{self.engine_logs.get(self.engine_url)}") from err
        self.engine_version = version
        dist.barrier()
        if holding:
            self.service.release()
        return timings

    def release_engine_memory(self) -> None:
        """GPU colocation: engines drop KV cache and weights while the trainer runs (no-op on CPU)."""
        if self.device.type != "cuda" or self.cfg.trainer.mode == "async":
            return

        async def release():
            async with EngineClient(self.engine_url) as client:
                await client.release_memory(["kv_cache", "weights"])

        self.run(release(), self.cfg.rollout.engine_timeout_s)

    # ------------------------------------------------------------------ assets, data, outputs

    def resolve_assets(self) -> None:
        """Policy, reward model and prompts paths; the offline tiny assets are built if missing."""
        cfg = self.cfg
        paths = None
        if "tiny" in (cfg.model.path, cfg.reward.model_path, cfg.data.train_path):
            from rl_core.assets import ensure_tiny_assets

            # Rank 0 builds (one log line) while the others wait; the build is locked and idempotent anyway.
            from rl_core.train_rm import ensure_tiny_reward_model

            quiet = lambda *_: None  # noqa: E731
            if self.rank == 0:
                paths = ensure_tiny_assets(log=print)
                if cfg.reward.model_path == "tiny":
                    ensure_tiny_reward_model(paths, log=print)
            dist.barrier()
            paths = ensure_tiny_assets(log=quiet)
        self.policy_path = str(paths.model_dir) if cfg.model.path == "tiny" else cfg.model.path
        if cfg.reward.model_path == "tiny":
            self.reward_path = str(ensure_tiny_reward_model(paths, log=quiet))
        else:
            self.reward_path = cfg.reward.model_path or None
        self.prompts_path = str(paths.train_prompts) if cfg.data.train_path == "tiny" else cfg.data.train_path
        from workers.models import load_tokenizer

        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path or self.policy_path)
        self.max_positions = model_max_positions(self.policy_path)

    def prompt_batches(self, batch_size: int, group_size: int) -> "PromptSamples":
        """Rank 0's endless, resumable stream of rollout samples (each prompt repeated group_size times)."""
        from rl_core.data import PromptLoader, QueryProcessor, load_prompt_dataset

        data = self.cfg.data
        dataset = load_prompt_dataset(self.prompts_path, text_key=data.text_key, on_malformed=data.on_malformed)
        if dataset.skipped:
            print(f"skipped {dataset.skipped} malformed prompt rows in {dataset.source}")
        processor = QueryProcessor(self.tokenizer, data.query_length, data.start_text, data.end_text)
        loader = PromptLoader(dataset, batch_size // group_size, seed=self.cfg.seed, processor=processor)
        return PromptSamples(loader, group_size, self.cfg.seed)

    def export_policy(self, model_state: dict[str, torch.Tensor], out_dir: Path) -> None:
        """The final policy in Hugging Face format (save_pretrained + tokenizer), loadable by SGLang."""
        if self.rank != 0:
            return
        from workers.models import load_causal_lm

        model = load_causal_lm(self.policy_path, vocab_size=len(self.tokenizer))
        model.load_state_dict(model_state)
        model.save_pretrained(out_dir)
        self.tokenizer.save_pretrained(out_dir)
        print(f"final policy saved to {out_dir}")


class PromptSamples:
    """Prompt batches as rollout samples. Queries go to the engine unpadded: with position ids
    from the exclusive cumsum of the mask, OpenAI's fixed-length left padding changes no logit,
    so padding happens only when micro-batches are collated."""

    def __init__(self, loader, group_size: int, seed: int):
        self.loader, self.group_size, self.seed = loader, group_size, seed
        self.served = 0  # samples handed out so far: each gets its own engine sampling seed

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        samples = []
        for item in self.loader.next_batch():
            for _ in range(self.group_size):
                # A per-sample seed makes a resumed run sample what the uninterrupted run would have.
                seed = (self.seed * 1_000_003 + self.served * 7_919) % (2**31 - 1)
                samples.append({**item.row, "prompt_ids": item.query.unpadded_ids, "index": item.index,
                                "sampling_seed": seed})
                self.served += 1
        return samples

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(), "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.served = state["served"]


async def wait_idle(client: EngineClient, deadline_s: float) -> None:
    """Poll until the engine has no running or queued request (async mode without partial rollout)."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + deadline_s
    while True:
        info = await client.server_info()
        if not info.get("running") and not info.get("queued"):
            return
        if loop.time() > give_up:
            raise EngineError(client.base_url, None, f"still busy after {deadline_s:g}s waiting to update weights")
        await asyncio.sleep(0.01)


def model_max_positions(path: str) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


def print_step(step: int, total: int, metrics: dict[str, float]) -> None:
    keys = ("reward/score_mean", "kl/mean", "kl/coef", "policy/entropy", "value/loss", "perf/step_s")
    shown = "  ".join(f"{k.split('/')[-1]}={metrics[k]:.3f}" for k in keys if k in metrics)
    print(f"step {step}/{total}  {shown}", flush=True)


def sample_rows(tokenizer, exp, n: int) -> list[dict]:
    """A few (query, response, score) rows for the samples table."""
    from rl_core.experience import final_response

    rows = []
    for t, traj in enumerate(exp.trajectories[:n]):
        context, response = final_response(traj)
        rows.append({"query": tokenizer.decode(context, skip_special_tokens=True),
                     "response": tokenizer.decode(response, skip_special_tokens=True),
                     "score": float(exp.scores[t])})
    return rows
