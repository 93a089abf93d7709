"""An engine started, either kind, the one way the job, the tests and the benchmarks start one: its server's
command line from its `EngineSpec`, on a free port of its host, owned by the caller's `ManagedProcesses`.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

from workers.engines.embedded import build_engine_argv
from workers.engines.embedded.forked import EngineFork
from workers.engines.sglang_engine import (build_server_argv, server_env, server_kwargs,
                                           server_python)
from workers.engines.spec import EngineSpec, is_vision_language
from workers.net import free_port, wait_http_ok
from workers.procs import ManagedProcesses, stop_process


def engine_argv(spec: EngineSpec, port: int) -> tuple[list[str], dict[str, str] | None]:
    """The command line and environment that start `spec`'s server on `port`."""
    if spec.kind == "embedded":
        return build_engine_argv(spec, port), None
    # (None would drop the CPU default pool: only a planned size replaces it.)
    pool = {} if spec.kv_tokens is None else {"max_total_tokens": int(spec.kv_tokens)}
    kwargs = server_kwargs(spec, port, extra={"random_seed": spec.seed, "context_length": spec.context_length,
                                              **pool, **spec.sglang_args})
    env = server_env(spec.gpu_ids, device=spec.device, vision=is_vision_language(spec.model_path))
    return build_server_argv(kwargs, server_python(spec.sglang_python)), env


@dataclasses.dataclass
class EngineProcess:
    """A running engine server: where it answers, its process and its log."""
    name: str  # "<kind> engine <url>", as errors and the process list call it
    url: str
    proc: subprocess.Popen
    log_path: Path

    def wait_ready(self, deadline_s: float) -> "EngineProcess":
        """Block until /health answers; an engine that exits or never answers is stopped and named."""
        try:
            wait_http_ok(f"{self.url}/health", deadline_s, self.proc, self.log_path, name=self.name)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, timeout)


def start_engine(spec: EngineSpec, log_path: Path, processes: ManagedProcesses, deadline_s: float,
                 wait: bool = True, fork: EngineFork | None = None) -> EngineProcess:
    """The one way an engine starts (job, tests, benchmarks): `spec`'s server on a free port of its
    host, owned by `processes`; with `wait`, once /health answers. `fork`: the rank's pre-imported
    child (`workers.engines.embedded.forked`), which an embedded engine runs in instead of a new Python."""
    port = free_port(spec.host)
    argv, env = engine_argv(spec, port)
    url = f"http://{spec.host}:{port}"
    name = f"{spec.kind} engine {url}"
    if fork is not None and spec.kind == "embedded":
        proc = processes.adopt(name, fork.start(argv, log_path, env), log_path)
    else:
        proc = processes.start(name, argv, log_path, env)
    engine = EngineProcess(name, url, proc, Path(log_path))
    return engine.wait_ready(deadline_s) if wait else engine
