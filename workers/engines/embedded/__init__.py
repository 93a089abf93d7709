"""Embedded inference engine: a small aiohttp server speaking the subset of SGLang's native API
the job uses, running a Hugging Face causal LM on CPU (or one small GPU).

    python -m workers.engines.embedded --model-path DIR --port P [--device cpu] [--dtype float32]

Because it speaks SGLang's API, the router, the rollout client, the weight push and the tests
are the same for both engines. `server.py` holds the HTTP side, `runner.py` the model and the
continuous batching; this module launches it as a subprocess.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from workers.procs import ManagedProcesses, free_port, start_process, stop_process, wait_http_ok


def build_engine_argv(model_path: str, port: int, host: str = "127.0.0.1", device: str = "cpu",
                      dtype: str = "float32", max_batch_size: int = 64, num_threads: int = 0,
                      seed: int = 0, python: str = sys.executable) -> list[str]:
    """Command line for `python -m workers.engines.embedded`."""
    return [python, "-m", "workers.engines.embedded", "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--device", device, "--dtype", dtype, "--max-batch-size", str(max_batch_size),
            "--num-threads", str(num_threads), "--seed", str(seed)]


@dataclasses.dataclass
class EngineProcess:
    """A running embedded engine subprocess."""
    url: str
    proc: subprocess.Popen
    log_path: Path

    def wait_ready(self, deadline_s: float = 120.0) -> "EngineProcess":
        try:
            wait_http_ok(f"{self.url}/health", deadline_s, self.proc, self.log_path, name=f"embedded engine {self.url}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, timeout)


def launch_embedded_engine(model_path: str, log_path: str | Path, host: str = "127.0.0.1",
                           port: int | None = None, processes: ManagedProcesses | None = None,
                           deadline_s: float = 120.0, wait: bool = True, env: dict | None = None,
                           **engine_args) -> EngineProcess:
    """Start an embedded engine; with `wait`, block until /health answers. `processes` (if given) owns it."""
    port = port or free_port(host)
    argv = build_engine_argv(model_path, port, host, **engine_args)
    url = f"http://{host}:{port}"
    proc = processes.start(f"embedded engine {url}", argv, log_path, env) if processes \
        else start_process(argv, log_path, env)
    engine = EngineProcess(url, proc, Path(log_path))
    return engine.wait_ready(deadline_s) if wait else engine
