"""The other nodes of a multi-node job: every engine reachable from node 0 before the rollout starts, and a node
lost afterwards noticed even when no connection says so.
"""

from __future__ import annotations

import threading
import time

from workers.net import http_problem
from workers.procs import ProcessStartError, stop_this_process


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
