"""The PPO job on two hosts with their own addresses: 2 nodes x 1 rank in two network namespaces.

Each node is a Linux network namespace with one end of a veth pair (its own address, its own
loopback); nothing leaves the machine. Needs root and iproute2 (CI runs as root); skipped
otherwise, with that reason.
"""

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.jobs import read_metrics
from tests.ppo.test_job import REPO, wait_gone

NODE_TIMEOUT_S = 12  # rollout.node_timeout_s of the lost-node runs: a cut link is noticed in this long


def netns(*args, check=True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture
def two_hosts():
    """Two namespaces joined by a veth pair: [(namespace, interface, address), ...]; removed afterwards."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2 (ip): run as root, as CI does")
    tag = f"{os.getpid() % 10000}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    hosts = [(f"rlnode{i}-{tag}", f"rlv{i}-{tag}", f"{subnet}.{i + 1}") for i in range(2)]
    try:
        for name, _, _ in hosts:
            netns("netns", "add", name)
        netns("link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1])
        for name, interface, address in hosts:
            netns("link", "set", interface, "netns", name)
            netns("-n", name, "addr", "add", f"{address}/24", "dev", interface)
            netns("-n", name, "link", "set", interface, "up")
            netns("-n", name, "link", "set", "lo", "up")
        yield hosts
    finally:
        for name, _, _ in hosts:
            netns("netns", "del", name, check=False)


def start_node(host, node_rank: int, master: str, port: int, overrides: list[str], log: Path) -> subprocess.Popen:
    name, interface, _ = host
    env = {**os.environ, "GLOO_SOCKET_IFNAME": interface}
    argv = ["ip", "netns", "exec", name, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--node_rank", str(node_rank), "--nproc_per_node", "1", "--master_addr", master, "--master_port",
            str(port), "-m", "rl_core.train", "--config", "ppo_sentiment.yaml", *overrides]
    with open(log, "w") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)


def listening(namespace: str, port: int) -> list[str]:
    """Local addresses a TCP socket listens on for `port`, inside `namespace`."""
    table = netns("netns", "exec", namespace, "ss", "-Hltn").stdout
    return [line.split()[3].rsplit(":", 1)[0] for line in table.splitlines() if line.split()[3].endswith(f":{port}")]


def finish(nodes, logs, timeout) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for proc, log in zip(nodes, logs):
        try:
            codes.append(proc.wait(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for p in nodes:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            pytest.fail(f"the nodes did not finish within {timeout}s:\n" +
                        "\n".join(f"--- {log}\n{log.read_text()[-3000:]}" for log in logs))
    return codes


@pytest.mark.timeout(900)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_two_nodes_train_with_engines_on_their_own_addresses(two_hosts, small_job, tmp_path, mode):
    run_dir = tmp_path / "run"
    overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", "trainer.total_episodes=24",
                                          f"trainer.mode={mode}"]
    master = two_hosts[0][2]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [start_node(host, i, master, 29400 + os.getpid() % 500, overrides, log)
             for i, (host, log) in enumerate(zip(two_hosts, logs))]
    codes = finish(nodes, logs, timeout=800)
    assert codes == [0, 0], "\n".join(log.read_text()[-3000:] for log in logs)
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(math.isfinite(m["reward/score_mean"]) for m in metrics)
    engines = json.loads((run_dir / "logs" / "engines.json").read_text())
    assert sorted(w["url"].split("//")[1].split(":")[0] for w in engines["workers"]) == [h[2] for h in two_hosts]
    assert [w["node"] for w in sorted(engines["workers"], key=lambda w: w["rank"])] == [0, 1]
    for rank, (namespace, _, address) in enumerate(two_hosts):
        engine_log = (run_dir / "logs" / f"engine-rank{rank}.log").read_text()
        assert f"--host {address}" in engine_log.splitlines()[0]  # bound to its node's address, not 0.0.0.0
    node0 = logs[0].read_text()
    assert re.search(rf"engine of rank 1 on node 1 \(\S+\): http://{re.escape(two_hosts[1][2])}:\d+", node0)
    assert wait_gone(str(small_job["root"])) == []


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["killed", "cut off"])
def test_a_lost_node_stops_every_node_within_a_minute_and_leaves_nothing(two_hosts, small_job, tmp_path, how):
    run_dir = tmp_path / "run"
    # A cut link is noticed by silence alone: after rollout.node_timeout_s, here shorter than its 30 s default.
    overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", "trainer.total_episodes=4000",
                                          "trainer.save_every=1", f"rollout.node_timeout_s={NODE_TIMEOUT_S}"]
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    nodes = [start_node(host, i, two_hosts[0][2], 29400 + os.getpid() % 500, overrides, log)
             for i, (host, log) in enumerate(zip(two_hosts, logs))]
    try:
        deadline = time.monotonic() + 600
        while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().strip()):
            assert all(p.poll() is None for p in nodes) and time.monotonic() < deadline, logs[0].read_text()[-3000:]
            time.sleep(1)
        for rank, (namespace, _, address) in enumerate(two_hosts):  # each engine listens on its node's address only
            port = int((run_dir / "logs" / f"engine-rank{rank}.log").read_text().split("--port ", 1)[1].split()[0])
            assert listening(namespace, port) == [address]
        lost = time.monotonic()
        if how == "killed":
            os.killpg(nodes[1].pid, signal.SIGKILL)  # node 1's torchrun; its ranks follow it down
            survivors = nodes[:1]
        else:  # the link goes down: no connection is closed, nothing is said
            netns("-n", two_hosts[1][0], "link", "set", two_hosts[1][1], "down")
            survivors = nodes
        codes = finish(survivors, logs[:len(survivors)], timeout=120)
        stopped_after = time.monotonic() - lost
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert all(code != 0 for code in codes) and stopped_after < 60, f"stopped after {stopped_after:.0f}s"
    if how == "cut off":  # the watch's setting, not its 30 s default, decided when
        assert stopped_after < 30, f"a cut link was noticed after {stopped_after:.0f}s, not rollout.node_timeout_s"
    # One line naming the lost node, whichever call met it first: a collective (closed sockets), the node
    # watch (silence), a checkpoint being written, or the rollout (its engine stopped answering).
    node0 = logs[0].read_text()
    lost = rf"({re.escape(two_hosts[1][2])}|node 1\b)"
    assert re.search(rf"^\[rank 0\] (stopped|error): .*{lost}", node0, re.M), node0[-3000:]
    if how == "cut off":
        node1 = logs[1].read_text()
        assert f"stopped: node 0 ({socket.gethostname()}) stopped answering" in node1, node1[-3000:]
    assert wait_gone(str(small_job["root"]), seconds=30) == []
    print(f"\nnode {how}: every node stopped {stopped_after:.1f}s later")


def test_a_wrong_multi_node_host_or_an_unreachable_engine_is_one_line_before_anything_runs():
    from rl_core.ppo.node_watch import check_reachable
    from workers.net import free_port, node_address
    from workers.procs import ProcessStartError

    with pytest.raises(ProcessStartError, match=r"rollout.multi_node_host=192.0.2.7 is not an address of this node"):
        node_address("192.0.2.7", "127.0.0.1", 29500)  # TEST-NET-1: never a local address; nothing is sent
    with pytest.raises(ProcessStartError, match="reached through loopback"):
        node_address(None, "127.0.0.1", 29500)
    assert node_address("127.0.0.1", "127.0.0.1", 29500) == "127.0.0.1"
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ProcessStartError, match=rf"engine of rank 0 on node 0 \(h\) at {closed} cannot be reached") as err:
        check_reachable([(closed, "log", {"node": 0, "host": "h"})], timeout_s=2)
    assert "\n" not in str(err.value)
