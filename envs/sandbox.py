"""A sandboxed Python runner for tool-calling environments: `await Sandbox().run_python(code)`.

Each call writes the code to `main.py` in a fresh private directory and runs `python -I main.py`
there in a fresh process, with stdin closed and a minimal environment (PATH, HOME, TMPDIR, LANG),
then kills whatever is left and removes the directory, on success, error, timeout and
cancellation alike. `Sandbox` holds the limits and an `asyncio.Semaphore` that bounds how many
calls run at once; share one instance between the trajectories of a job. `run_python(code, ...)`
is a one-off convenience.

How it is built, from util-linux `setpriv` and `unshare` and the stdlib:

    [setpriv to `user` when root] unshare --user --net --pid --ipc --uts --mount-proc --fork --kill-child
        └─ runner: python -I -S -c _RUNNER          PID 1 of the new namespaces
            └─ setrlimit(...); exec python -I main.py   the code

The limits are set by the runner rather than with `preexec_fn`, which is unsafe in a process with
threads (the rollout has thread pools), and Python 3.11 has no `os.unshare`.

Enforced (checked by tests/envs/test_sandbox.py on Linux 6.x as root):
  * User: a root parent starts `unshare` as `user` ("nobody", via `setpriv`, with no_new_privs):
    the code runs as an unprivileged host user, with no capabilities (the new user namespace maps
    no ids). It cannot write the
    project, root-owned files or other users' files, and cannot ptrace its runner (which is not
    dumpable). A non-root parent cannot switch users, so there the code runs as the caller.
  * Network: a new network namespace whose only interface is a loopback that is down, so no IP
    traffic at all, not even to 127.0.0.1 (connect fails with ENETUNREACH).
  * Processes: a new PID namespace with its own /proc; the code sees and can signal only its own
    processes. The runner enforces the wall clock and, when the code exits, times out, or the
    parent closes the control socket (the caller was cancelled, or the parent died), SIGKILLs
    every process in the namespace, setsid'd ones included, and reaps them before it exits: when
    a call returns nothing of it is left. The parent kills the process group should the runner
    hang past timeout_s + RUNNER_GRACE_S; the kernel then takes the namespace with its init.
  * Limits on the code and its children: RLIMIT_AS (`memory_mb`: a memory bomb gets
    MemoryError), RLIMIT_CPU (`cpu_s`, SIGXCPU), RLIMIT_FSIZE (`max_file_mb` per file),
    RLIMIT_CORE 0 and RLIMIT_NPROC (`max_processes`, the code's own process and threads
    included). RLIMIT_NPROC is per user and ignored for root, but here it is set inside the code's
    own user namespace, where the kernel counts processes per namespace: it caps each call
    separately although every call runs as the same user, needs no root and no cgroup, and stops
    a fork bomb. The limit set is max_processes + 2, for `unshare` and the runner counted with it.
  * Output is read as it comes; only the first `max_output_bytes` of each stream are kept.

Not enforced:
  * Reads: the code reads every file its user may, world-readable project files included
    (a read-only view of the filesystem needs a mount namespace tool such as bubblewrap).
  * World-writable directories (/tmp, /var/tmp, /dev/shm) stay writable, and what the code
    leaves there is not removed; total disk use is not bounded, only each file's size.
  * Unix sockets on the filesystem that the user may open stay reachable (no IP, but IPC).
  * Calls run as one user: each directory sits at an unguessable name in a directory the user may
    enter but not list, so calls cannot find each other's files, but /tmp and /dev/shm are shared.
  * A parent killed with SIGKILL takes its sandboxes' processes with it, not their directories.

Needs Linux with unprivileged user namespaces (`unshare --user` must work for `user`; Ubuntu
24.04, for one, restricts them with AppArmor) and a Python >= 3.9 that `user` can run: by default
the `python3` on /usr/local/bin:/usr/bin:/bin, not the project's venv, which may sit under a home
the sandbox user cannot enter. Where a call cannot start, `run_python` raises `SandboxError`.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import signal
import socket
import tempfile
import time
from dataclasses import dataclass

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
DEFAULT_MAX_CONCURRENCY = 8
# How long past timeout_s the parent waits for the runner before killing it by its process group.
RUNNER_GRACE_S = 5.0
READ_CHUNK = 65536

# PID 1 of the sandbox's namespaces: starts the code with its limits, enforces the wall clock,
# then kills and reaps everything and sends the code's wait status back on the control socket.
# A string for `python -c` because the sandbox user may not be able to read this file.
# argv: control fd, timeout, limits "NAME=soft:hard,...", command...
_RUNNER = r"""
import ctypes, os, resource, select, signal, sys
if os.getpid() != 1:  # kill(-1) below would reach every process this user has outside a PID namespace
    sys.exit("sandbox: the runner is not PID 1 of a new PID namespace; refusing to run")
# PR_SET_DUMPABLE 0: the code runs as the same user, and could otherwise ptrace its runner (stop
# it, or make it report another status). exec resets this for the code itself.
ctypes.CDLL(None).prctl(4, 0)
# As init, with the default handler a signal from inside the namespace is simply not delivered,
# so the code cannot interrupt its runner.
signal.signal(signal.SIGINT, signal.SIG_DFL)
control, timeout, limits, command = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4:]
os.set_inheritable(control, False)
child = os.fork()
if child == 0:
    try:
        for signum in (signal.SIGPIPE, signal.SIGXFSZ):  # Python ignores them; the code's children should not
            signal.signal(signum, signal.SIG_DFL)
        for item in limits.split(","):
            name, soft, hard = item.replace("=", ":").split(":")
            resource.setrlimit(getattr(resource, name), (int(soft), int(hard)))
        os.execv(command[0], command)
    except BaseException as err:
        os.write(2, f"sandbox: cannot start {command[0]}: {err}\n".encode())
    os._exit(127)
finished = os.pidfd_open(child)
# Readable control socket: the parent closed it (cancelled, or gone).
ready, _, _ = select.select([finished, control], [], [], timeout)
os.kill(-1, signal.SIGKILL)  # from init: every other process in the namespace
_, status = os.waitpid(child, 0)
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
try:
    os.write(control, f"{status} {int(not ready)}".encode())
except OSError:
    pass
"""


class SandboxError(RuntimeError):
    """The sandbox could not run the code at all (a setup problem, not the code's fault)."""


@dataclass
class SandboxResult:
    """What one run did. Truncated streams end with a line saying how much was written."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when a signal ended the code
    signal: int | None  # SIGKILL at the wall-clock limit, SIGXCPU at the CPU limit
    timed_out: bool
    seconds: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def for_model(self) -> str:
        """The result as a tool message's text: what was printed, and what went wrong, if anything."""
        if self.timed_out:
            return f"{self.stdout}error: the program did not finish within {self.seconds:.0f} s and was stopped"
        if not self.ok:
            how = f"exit code {self.exit_code}" if self.exit_code is not None else f"signal {self.signal}"
            return f"{self.stdout}{self.stderr}error: the program failed ({how})"
        return self.stdout


class Sandbox:
    """Runs untrusted Python with the limits given here, at most `max_concurrency` at a time."""

    def __init__(self, max_concurrency: int = DEFAULT_MAX_CONCURRENCY, *, timeout_s: float = 10.0,
                 memory_mb: int = 512, max_output_bytes: int = 16384, max_processes: int = 32,
                 max_file_mb: int = 16, cpu_s: int | None = None, python: str | None = None,
                 user: str = "nobody"):
        for name, value in [("max_concurrency", max_concurrency), ("timeout_s", timeout_s),
                            ("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes),
                            ("max_processes", max_processes), ("max_file_mb", max_file_mb)]:
            if not value > 0:
                raise ValueError(f"sandbox {name} must be > 0, got {value!r}")
        if cpu_s is not None and cpu_s < 1:
            raise ValueError(f"sandbox cpu_s must be a whole number of seconds >= 1 (or None), got {cpu_s!r}")
        self.unshare = shutil.which("unshare")
        if self.unshare is None:
            raise ValueError("sandbox needs util-linux's `unshare` on PATH (apt install util-linux)")
        self.python = python or shutil.which("python3", path=SANDBOX_PATH)
        if self.python is None:
            raise ValueError(f"sandbox found no python3 on {SANDBOX_PATH}: pass python='/path/to/python3'")
        if os.geteuid() == 0:
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                raise ValueError(f"sandbox user {user!r} does not exist: pass an unprivileged account such as "
                                 "'nobody'") from None
            if entry.pw_uid == 0:
                raise ValueError(f"sandbox user {user!r} is root: pass an unprivileged account such as 'nobody'")
            self.uid, self.gid = entry.pw_uid, entry.pw_gid
            # setpriv rather than Popen(user=...), which rules out vfork: a fork of a parent with
            # gigabytes resident blocks the event loop for ~0.1 s per call, vfork does not.
            setpriv = shutil.which("setpriv")
            if setpriv is None:
                raise ValueError("sandbox run as root needs util-linux's `setpriv` on PATH (apt install util-linux)")
            self.drop = [setpriv, f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--no-new-privs",
                         "--"]
        else:
            self.uid = self.gid = None  # cannot switch users: the code runs as the caller
            self.drop = []
        self.timeout_s = timeout_s
        self.max_output_bytes = max_output_bytes
        # RLIMIT_CPU: a backstop for CPU-bound code, after the wall clock by default. The soft limit
        # sends SIGXCPU, the hard one a second later SIGKILL (were they equal, only SIGKILL: no telling why).
        cpu = cpu_s if cpu_s is not None else int(timeout_s) + 2
        memory, file_size = memory_mb * 2**20, max_file_mb * 2**20
        limits = {"RLIMIT_AS": (memory, memory), "RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_FSIZE": (file_size, file_size),
                  "RLIMIT_NPROC": (max_processes + 2, max_processes + 2), "RLIMIT_CORE": (0, 0)}
        self.limits = ",".join(f"{name}={soft}:{hard}" for name, (soft, hard) in limits.items())
        self._slots = asyncio.Semaphore(max_concurrency)

    async def run_python(self, code: str) -> SandboxResult:
        """Run `code` as a script; waits for a free slot first."""
        async with self._slots:
            with tempfile.TemporaryDirectory(prefix="sandbox-") as outer:
                # Every call runs as the same user, so its directory sits at an unguessable name
                # inside one the user may enter but not list: calls cannot find each other's files.
                os.chmod(outer, 0o711)
                workdir = tempfile.mkdtemp(dir=outer)
                script = os.path.join(workdir, "main.py")
                with open(script, "w", encoding="utf-8") as f:
                    f.write(code)
                if self.uid is not None:
                    os.chown(workdir, self.uid, self.gid)
                    os.chown(script, self.uid, self.gid)
                return await self._run(workdir)

    async def _run(self, workdir: str) -> SandboxResult:
        command = [*self.drop, self.unshare, "--user", "--net", "--pid", "--ipc", "--uts", "--mount-proc", "--fork",
                   "--kill-child", self.python, "-I", "-S", "-c", _RUNNER]
        parent_end, runner_end = socket.socketpair()
        command += [str(runner_end.fileno()), str(self.timeout_s), self.limits, self.python, "-I", "main.py"]
        env = {"PATH": SANDBOX_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}
        started = time.monotonic()
        with parent_end:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, cwd=workdir, env=env, start_new_session=True,
                    pass_fds=(runner_end.fileno(),))
            finally:
                runner_end.close()
            readers = [asyncio.create_task(_read(stream, self.max_output_bytes))
                       for stream in (proc.stdout, proc.stderr)]
            exited = asyncio.create_task(proc.wait())
            try:
                # The runner enforces timeout_s; waiting longer only covers a runner that hangs.
                await asyncio.wait([*readers, exited], timeout=self.timeout_s + RUNNER_GRACE_S)
                runner_hung = proc.returncode is None
                report = None if runner_hung else _receive(parent_end)
                if runner_hung:
                    os.killpg(proc.pid, signal.SIGKILL)  # --kill-child then takes the runner and its namespace
                    await proc.wait()
                    await asyncio.wait(readers, timeout=1.0)  # what the code wrote before it was killed
            finally:
                if proc.returncode is None:  # an error here, or the caller was cancelled
                    await _stop(proc, parent_end)
                for task in [*readers, exited]:
                    task.cancel()
        (out, out_total), (err, err_total) = [_collected(reader) for reader in readers]
        seconds = time.monotonic() - started
        if report is None and not runner_hung:
            # The runner ended on its own without a report: it could not start at all.
            detail = err.decode(errors="replace").strip().splitlines()
            raise SandboxError(f"sandbox could not start ({detail[-1] if detail else f'exit {proc.returncode}'}); "
                               "it needs unprivileged user namespaces (unshare --user) and a python the "
                               "sandbox user can run")
        status, timed_out = report if report is not None else (None, True)
        code = os.waitstatus_to_exitcode(status) if status is not None else -signal.SIGKILL
        return SandboxResult(
            stdout=_text(out, out_total, self.max_output_bytes), stderr=_text(err, err_total, self.max_output_bytes),
            exit_code=code if code >= 0 else None, signal=-code if code < 0 else None, timed_out=timed_out,
            seconds=seconds, stdout_truncated=out_total > len(out), stderr_truncated=err_total > len(err))


async def run_python(code: str, *, timeout_s: float = 10.0, memory_mb: int = 512, max_output_bytes: int = 16384,
                     max_processes: int = 32, max_file_mb: int = 16, cpu_s: int | None = None,
                     python: str | None = None, user: str = "nobody") -> SandboxResult:
    """Run `code` once in its own sandbox. For many concurrent calls share one `Sandbox` instead."""
    sandbox = Sandbox(1, timeout_s=timeout_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes,
                      max_processes=max_processes, max_file_mb=max_file_mb, cpu_s=cpu_s, python=python, user=user)
    return await sandbox.run_python(code)


async def python(code: str) -> str:
    """Run a Python program and return what it printed.

    Args:
        code: The program's source. Print the values you want to see.
    """
    # A tool for `env.tools: [envs.sandbox:python]`: each call gets its own sandbox with the default
    # limits; the env pool's `num_envs` bounds how many run at once.
    return (await run_python(code)).for_model()


async def _read(stream: asyncio.StreamReader, limit: int) -> tuple[bytes, int]:
    """Keep the first `limit` bytes and count the rest, draining the pipe so the writer never blocks."""
    kept = bytearray()
    total = 0
    while chunk := await stream.read(READ_CHUNK):
        total += len(chunk)
        if len(kept) < limit:
            kept += chunk[: limit - len(kept)]
    return bytes(kept), total


def _collected(reader: asyncio.Task) -> tuple[bytes, int]:
    return reader.result() if reader.done() and not reader.cancelled() else (b"", 0)


def _text(data: bytes, total: int, limit: int) -> str:
    text = data.decode("utf-8", errors="replace")
    if total > len(data):
        text += f"\n[output truncated: {total} bytes written, the first {limit} kept]"
    return text


def _receive(control: socket.socket) -> tuple[int, bool] | None:
    """The runner's report (`wait status`, `timed out`), sent before it exited; None if it sent none."""
    control.setblocking(False)
    try:
        status, timed_out = control.recv(64).decode().split()
    except (BlockingIOError, ValueError):
        return None
    return int(status), timed_out == "1"


async def _stop(proc: asyncio.subprocess.Process, control: socket.socket) -> None:
    """Kill the run now: closing the control socket makes the runner kill and reap everything."""
    control.close()
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), RUNNER_GRACE_S)
    except asyncio.TimeoutError:
        # A stuck runner: kill the process group; --kill-child then kills the runner, and with it,
        # being the namespace's init, every process in the namespace.
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
