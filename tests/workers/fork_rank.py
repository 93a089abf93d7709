"""A stand-in rank for tests/workers/test_engine_fork.py, run as `python -m tests.workers.fork_rank MODE MODEL_DIR LOG_DIR`.

It does what a PPO rank does around its engine fork (torchrun's OMP_NUM_THREADS=1 until then, a socket
opened before the fork and closed after, the trainer's threads and ops after it) and prints one JSON line of
what it saw. MODE: `serve` (start the fork as the engine, greedy-generate, stop it), `close` (close it unused),
`die` (print the fork's pid, then wait to be killed).
"""

import json
import socket
import sys
import time
import urllib.request
from pathlib import Path

import torch

from workers.engines.embedded import build_engine_argv
from workers.engines.embedded.forked import EngineFork
from workers.engines.launch import EngineProcess
from workers.engines.spec import EngineSpec
from workers.net import free_port
from workers.procs import ManagedProcesses

PROMPT = [5, 17, 42, 8, 99, 3]


def greedy(url: str) -> list[int]:
    body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0,
                                                                "ignore_eos": True}}).encode()
    request = urllib.request.Request(f"{url}/generate", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())["output_ids"]


def main(mode: str, model_dir: str, log_dir: str) -> None:
    held = socket.socket()  # a descriptor the rank holds at the fork, as a process group's store would
    held.bind(("127.0.0.1", 0))
    held.listen()
    held_port = held.getsockname()[1]
    fork = EngineFork.fork()
    held.close()
    if mode == "die":
        print(json.dumps({"fork_pid": fork.process.pid}), flush=True)
        time.sleep(600)
    if mode == "close":
        fork.close()
        print(json.dumps({"fork_pid": fork.process.pid, "code": fork.process.returncode}), flush=True)
        return
    torch.set_num_threads(2)  # the trainer's threads, after the fork, busy while the engine starts
    a = torch.randn(1024, 1024)
    for _ in range(4):
        a = torch.tanh(a @ a)
    rebound = socket.socket()
    rebound.bind(("127.0.0.1", held_port))  # fails while any process still holds the rank's socket
    rebound.close()
    spec = EngineSpec("embedded", model_dir, "float32", "cpu", num_threads=2)
    answers, logs, port_of = {}, {}, {}
    with ManagedProcesses() as procs:
        for how in ("forked", "command"):
            port = port_of[how] = free_port()
            argv = build_engine_argv(spec, port)
            log = Path(log_dir) / f"{how}.log"
            name = f"{how} engine"
            proc = procs.adopt(name, fork.start(argv, log), log) if how == "forked" else procs.start(name, argv, log)
            url = f"http://127.0.0.1:{port}"
            EngineProcess(name, url, proc, log).wait_ready(120)
            answers[how] = greedy(url)
            logs[how] = str(log)
            if how == "forked":
                cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        procs.stop_all("the test is done")
    print(json.dumps({"fork_pid": fork.process.pid, "code": fork.process.returncode, "answers": answers,
                      "logs": logs, "cmdline": cmdline, "port": port_of["forked"],
                      "trainer_sum": float(a.sum())}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
