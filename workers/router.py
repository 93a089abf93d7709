"""Launch sglang-router in its own process and register engines with it.

The router runs with health checks, the circuit breaker and retries off:
- engines are paused or have released memory between rollouts; health probes would mark them
  unhealthy and the router would stop sending them work (reference section 7.2);
- a retried /generate could run twice and give the trainer a sample it never sees.
Its Prometheus exporter gets its own free port, because the default (29000) makes a second
router on the host panic.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from workers.net import free_port, wait_http_ok
from workers.procs import ManagedProcesses, ProcessStartError, log_tail, stop_process, start_process

POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")


@dataclasses.dataclass(frozen=True)
class RouterSettings:
    """How sglang-router picks an engine for each request, how long a request may take, and how much it logs."""
    policy: str = "cache_aware"  # one of POLICIES
    request_timeout_s: int = 1800
    # cache_aware only: (abs, rel); the router sends a request to the engine with the fewest requests in
    # flight once `max - min > abs` and `max > min * rel` (None: the router's defaults, 64, 1.5);
    # (0, 1.0) always picks the least loaded engine.
    balance: tuple[int, float] | None = None
    log_level: str = "warn"


def build_router_argv(host: str, port: int, prometheus_port: int, settings: RouterSettings = RouterSettings(),
                      worker_urls: Sequence[str] = (), python: str = sys.executable) -> list[str]:
    """Command line for `python -m sglang_router.launch_router` with `settings`.

    `worker_urls` known at launch go on the command line (power_of_two refuses to start with
    fewer than 2).
    """
    if settings.policy not in POLICIES:
        raise ValueError(f"router policy {settings.policy!r} is not one of {POLICIES}")
    balance = settings.balance
    thresholds = (["--balance-abs-threshold", str(int(balance[0])), "--balance-rel-threshold", str(float(balance[1]))]
                  if balance is not None else [])
    return [
        python, "-m", "sglang_router.launch_router",
        "--host", host, "--port", str(port),
        "--prometheus-host", host, "--prometheus-port", str(prometheus_port),
        "--policy", settings.policy,
        "--disable-health-check", "--disable-circuit-breaker", "--disable-retries",
        "--request-timeout-secs", str(int(settings.request_timeout_s)),
        "--log-level", settings.log_level,
    ] + thresholds + (["--worker-urls", *worker_urls] if worker_urls else [])


def _http_json(method: str, url: str, payload: dict | None = None, timeout: float = 5.0) -> tuple[int, object]:
    data = json.dumps(payload).encode() if payload is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as err:
        body, status = err.read().decode(errors="replace"), err.code
    try:
        return status, json.loads(body) if body else None
    except ValueError:
        return status, body


class RouterProcess:
    """One sglang-router process; `url` is where clients send /generate."""

    def __init__(self, host: str = "127.0.0.1", port: int | None = None, log_path: str | Path = "router.log",
                 settings: RouterSettings = RouterSettings(), processes: ManagedProcesses | None = None,
                 worker_urls: Sequence[str] = ()):
        self.host = host
        self.port = port or free_port(host)
        self.prometheus_port = free_port(host)
        self.log_path = Path(log_path)
        self.initial_workers = list(worker_urls)
        self.argv = build_router_argv(host, self.port, self.prometheus_port, settings, self.initial_workers)
        self.processes = processes
        self.proc = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, deadline_s: float = 60.0) -> "RouterProcess":
        if self.processes is not None:
            self.proc = self.processes.start("sglang-router", self.argv, self.log_path)
        else:
            self.proc = start_process(self.argv, self.log_path)
        wait_http_ok(f"{self.url}/health", deadline_s, self.proc, self.log_path, name="sglang-router")
        return self

    def workers(self) -> list[dict]:
        status, body = _http_json("GET", f"{self.url}/workers")
        if status != 200 or not isinstance(body, dict):
            raise ProcessStartError(f"router {self.url} GET /workers: HTTP {status} {body}")
        return list(body.get("workers", []))

    def wait_workers_healthy(self, worker_urls: Sequence[str], deadline_s: float) -> None:
        wanted = {u.rstrip("/") for u in worker_urls}
        give_up_at = time.monotonic() + deadline_s
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ProcessStartError(f"sglang-router exited with code {self.proc.returncode}; "
                                        f"log {self.log_path}:\n{log_tail(self.log_path)}")
            healthy = {w["url"].rstrip("/") for w in self.workers() if w.get("is_healthy", True)}
            if wanted <= healthy:
                return
            if time.monotonic() > give_up_at:
                raise ProcessStartError(f"router {self.url}: workers {sorted(wanted - healthy)} not healthy after "
                                        f"{deadline_s:.0f}s; log {self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.1)

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.processes is not None:
            self.processes.stop(self.proc)
        else:
            stop_process(self.proc, timeout)
        self.proc = None

    def __enter__(self) -> "RouterProcess":
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()


def launch_router(host: str, port: int | None, worker_urls: Sequence[str], log_path: str | Path,
                  settings: RouterSettings = RouterSettings(), processes: ManagedProcesses | None = None,
                  deadline_s: float = 60.0) -> RouterProcess:
    """Start a router with `settings`, register `worker_urls`, wait until they are healthy; stop it on any failure."""
    router = RouterProcess(host, port, log_path, settings, processes, worker_urls)
    router.start(deadline_s)
    try:
        router.wait_workers_healthy(worker_urls, deadline_s)
    except BaseException:
        router.stop()
        raise
    return router
