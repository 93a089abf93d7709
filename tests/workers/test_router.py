"""Real sglang-router in front of two embedded engines, failure handling, and process hygiene."""

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from workers.engines.client import EngineClient, EngineError
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.net import wait_http_ok
from workers.procs import ManagedProcesses, ProcessStartError, start_process, stop_process
from workers.router import RouterSettings, build_router_argv, launch_router


def is_alive(pid: int) -> bool:
    """True unless the pid is gone or a zombie (psutil is not a dependency, so read /proc)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def wait_until(predicate, timeout: float) -> bool:
    give_up_at = time.monotonic() + timeout
    while time.monotonic() < give_up_at:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router_logs")
    with ManagedProcesses() as procs:
        spec = EngineSpec("embedded", str(tiny_model_dir), "float32", "cpu", num_threads=1)
        engines = [start_engine(spec, logs / f"engine{i}.log", procs, deadline_s=120, wait=False) for i in range(2)]
        for engine in engines:  # both load at once
            engine.wait_ready(120)
        router = launch_router("127.0.0.1", None, [e.url for e in engines], logs / "router.log",
                               RouterSettings(policy="round_robin"), processes=procs)
        yield {"procs": procs, "engines": engines, "router": router}


def run(coro_factory, url, timeout_s=30.0):
    async def main():
        async with EngineClient(url, timeout_s=timeout_s) as client:
            return await coro_factory(client)
    return asyncio.run(main())


def test_router_argv_turns_off_health_checks_retries_and_uses_own_ports():
    argv = build_router_argv("127.0.0.1", 31000, 31001, RouterSettings(policy="round_robin"))
    for flag in ("--disable-health-check", "--disable-circuit-breaker", "--disable-retries"):
        assert flag in argv
    assert argv[argv.index("--port") + 1] == "31000" and argv[argv.index("--prometheus-port") + 1] == "31001"
    with pytest.raises(ValueError, match="policy"):
        build_router_argv("127.0.0.1", 1, 2, RouterSettings(policy="fastest"))


@pytest.mark.timeout(180)
def test_requests_through_the_router_reach_both_engines(stack):
    engines, router = stack["engines"], stack["router"]
    before = [run(lambda c: c.server_info(), e.url)["internal_states"][0]["requests_finished"] for e in engines]
    params = {"max_new_tokens": 6, "ignore_eos": True}

    async def body(client):
        singles = await asyncio.gather(*(client.generate([10 + i, 11], params) for i in range(12)))
        batch = await client.generate([[5], [6, 7], [8, 9, 10]], params)
        return singles, batch
    singles, batch = run(body, router.url)
    assert all(len(r["output_ids"]) == 6 for r in singles)
    assert [r["meta_info"]["prompt_tokens"] for r in batch] == [1, 2, 3]
    after = [run(lambda c: c.server_info(), e.url)["internal_states"][0]["requests_finished"] for e in engines]
    served = [a - b for a, b in zip(after, before)]
    assert sum(served) == 15 and min(served) > 0, served
    listed = {w["url"] for w in router.workers()}
    assert listed == {e.url for e in engines}


def test_the_routers_probes_are_one_warning_line_in_the_engine_log_not_an_error(stack):
    """sglang-router opens each engine with HTTP/2 probes the engine cannot parse; SGLang logs each as one
    warning line, and so must the embedded engine: an ERROR with a traceback in its log sent users hunting."""
    for engine in stack["engines"]:
        log = engine.log_path.read_text()
        assert "Traceback" not in log and " ERROR " not in log, log[-2000:]
        assert log.count("WARNING Invalid HTTP request received.") == log.count('"UNKNOWN / HTTP/1.0" 400')


@pytest.mark.timeout(120)
def test_a_killed_engine_gives_a_quick_clear_error_not_a_hang(stack):
    engines, router = stack["engines"], stack["router"]
    dead = engines[1]
    os.kill(dead.proc.pid, signal.SIGKILL)
    dead.proc.wait(timeout=10)
    started = time.monotonic()
    with pytest.raises(EngineError, match=dead.url):
        run(lambda c: c.generate([5], {"max_new_tokens": 2}), dead.url)
    assert time.monotonic() - started < 5

    async def through_router(client):
        return await asyncio.gather(*(client.generate([5 + i], {"max_new_tokens": 2}) for i in range(6)),
                                    return_exceptions=True)
    started = time.monotonic()
    results = run(through_router, router.url)
    assert time.monotonic() - started < 15
    errors = [r for r in results if isinstance(r, Exception)]
    assert errors and all(isinstance(e, EngineError) and router.url in str(e) for e in errors)
    assert any(isinstance(r, dict) for r in results)  # the live engine still answers


@pytest.mark.timeout(120)
def test_clean_shutdown_leaves_no_processes(stack):
    procs = stack["procs"]
    pids = [engine.proc.pid for engine in stack["engines"]] + [stack["router"].proc.pid]
    procs.stop_all()
    assert not any(is_alive(pid) for pid in pids)
    assert not any(group_members(pid) for pid in pids)


# ---------------------------------------------------------------- process utilities

@pytest.mark.timeout(60)
def test_wait_http_ok_names_the_process_and_its_log_when_it_dies(tmp_path):
    log = tmp_path / "crash.log"
    proc = start_process([sys.executable, "-c", "print('model file is missing'); raise SystemExit(3)"], log)
    with pytest.raises(ProcessStartError) as err:
        wait_http_ok("http://127.0.0.1:9/health", 30, proc, log, name="engine-7")
    message = str(err.value)
    assert "engine-7" in message and "code 3" in message and str(log) in message
    assert "model file is missing" in message


@pytest.mark.timeout(60)
def test_http_problem_says_what_a_health_probe_met():
    """The one probe behind engine start-up, rollout errors and node watching: None on 200, else one phrase."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from workers.net import free_port, http_problem

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert http_problem(f"{url}/health", 5) is None
        assert http_problem(f"{url}/paused", 5) == "HTTP 503"
    finally:
        server.shutdown()
        server.server_close()
    assert "Connection refused" in http_problem(f"http://127.0.0.1:{free_port()}/health", 5)


@pytest.mark.timeout(60)
def test_wait_http_ok_deadline(tmp_path):
    started = time.monotonic()
    with pytest.raises(ProcessStartError, match="within 1s"):
        wait_http_ok("http://127.0.0.1:9/health", 1.0)
    assert time.monotonic() - started < 5


@pytest.mark.timeout(60)
def test_stop_process_kills_a_child_that_ignores_sigterm(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = start_process([sys.executable, "-c", code], tmp_path / "stubborn.log")
    assert wait_until(lambda: b"\nready" in (tmp_path / "stubborn.log").read_bytes(), 30)
    stop_process(proc, timeout=0.5)
    assert proc.returncode == -signal.SIGKILL and not is_alive(proc.pid)


@pytest.mark.timeout(60)
def test_children_die_with_their_parent_and_with_the_registry(tmp_path):
    child_pid_file = tmp_path / "child.pid"
    parent_code = (
        "import sys, time; from workers.procs import start_process; "
        f"p = start_process(['sleep', '60'], {str(tmp_path / 'child.log')!r}); "
        f"open({str(child_pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    parent = start_process([sys.executable, "-c", parent_code], tmp_path / "parent.log")
    assert wait_until(lambda: child_pid_file.exists() and child_pid_file.read_text(), 30)
    child_pid = int(child_pid_file.read_text())
    assert is_alive(child_pid)
    os.kill(parent.pid, signal.SIGKILL)  # no cleanup code runs: only PR_SET_PDEATHSIG can stop the child
    parent.wait()
    assert wait_until(lambda: not is_alive(child_pid), 10)

    with ManagedProcesses(stop_timeout=2) as procs:
        sleepers = [procs.start(f"sleep{i}", ["sleep", "60"], tmp_path / f"s{i}.log") for i in range(2)]
    assert not any(is_alive(p.pid) for p in sleepers)
