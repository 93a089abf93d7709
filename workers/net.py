"""A rank's network: free ports for its servers, the node's own address, and the one HTTP health probe of
launches, rollout errors and node watching.
"""

from __future__ import annotations

import random
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from workers.procs import ProcessStartError, log_tail


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now, below the kernel's ephemeral range.

    The server given it binds it only later (SGLang after about 25 s of start-up on a CPU), and a
    port from the ephemeral range can meanwhile be handed to any `bind(0)` or outgoing connection:
    SGLang's own scheduler took its server's HTTP port that way for a gloo socket (`[Errno 98]`).
    Ports below the range are never assigned automatically."""
    low = _ephemeral_range()[0]
    chooser = random.SystemRandom()
    for _ in range(100):
        port = chooser.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # everything below taken: the old way
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for automatically assigned ports (Linux's default where it cannot be read)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def node_address(given: str | None, peer: str, peer_port: int) -> str:
    """This node's address for a multi-node job: `given` (rollout.multi_node_host) once checked to be
    one of this node's, else the address of the interface that reaches `peer` (node 0, torchrun's
    MASTER_ADDR). Not the host name: on most Debian and Ubuntu machines it resolves to loopback.
    """
    if given:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((given, 0))
        except OSError as err:
            raise ProcessStartError(f"rollout.multi_node_host={given} is not an address of this node "
                                    f"({socket.gethostname()}: {err.strerror}); give one of its own addresses "
                                    "(ip -brief addr) or leave it unset to use the one that reaches node 0") from None
        return given
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((peer, peer_port))  # UDP: picks the route and its source address, sends nothing
            address = sock.getsockname()[0]
    except OSError as err:
        raise ProcessStartError(f"cannot find the address of this node that reaches node 0 ({peer}): "
                                f"{err.strerror}; set rollout.multi_node_host to this node's address") from None
    if address.startswith("127."):
        raise ProcessStartError(f"node 0 ({peer}) is reached through loopback, so this node's address for the other "
                                "nodes is unknown; give torchrun node 0's network address (--master_addr or "
                                "--rdzv-endpoint) or set rollout.multi_node_host")
    return address


def http_problem(url: str, timeout_s: float) -> str | None:
    """None when a GET of `url` answers HTTP 200 within `timeout_s`, else what went wrong (`HTTP 503`, the
    connection's error): the one health probe of launches, rollout errors and node watching."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as err:
        return f"HTTP {err.code}"
    except (urllib.error.URLError, OSError) as err:
        return str(getattr(err, "reason", err))


def wait_http_ok(url: str, deadline_s: float, proc: subprocess.Popen | None = None,
                 log_path: str | Path | None = None, name: str | None = None) -> None:
    """Poll `url` until it answers HTTP 200; raise ProcessStartError if `proc` exits or time runs out."""
    name = name or (f"process {proc.pid}" if proc is not None else url)
    give_up_at = time.monotonic() + deadline_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise ProcessStartError(
                f"{name} exited with code {proc.returncode} before {url} answered; "
                f"log {log_path}:\n{log_tail(log_path)}")
        last_error = http_problem(url, timeout_s=2.0)
        if last_error is None:
            return
        if time.monotonic() > give_up_at:
            raise ProcessStartError(
                f"{name} did not answer 200 on {url} within {deadline_s:.0f}s ({last_error}); "
                f"log {log_path}:\n{log_tail(log_path)}")
        time.sleep(0.1)
