"""The sandbox's runner (used by `envs.sandbox`): the program PID 1 of each call's namespaces runs, and the
control socket between it and the trainer."""

from __future__ import annotations

import socket

# PID 1 of the sandbox's namespaces. bwrap starts it with CAP_SYS_ADMIN and CAP_SYS_RESOURCE in the call's own
# user namespace (and no other), which it uses once, before any of the code runs, to set up what bwrap cannot:
# tmpfs with an inode cap (a mount namespace of its own, where it may mount), a devpts with few ptys, the per-user
# kernel limits of its user namespace, /proc/sys read-only, and a fresh session keyring. Then it drops every
# capability, loads the seccomp filter (so it binds the runner and all the code), starts the code with its
# rlimits, enforces the wall clock, kills and reaps everything and sends the code's wait status back on the
# control socket. A string for `python -c` because the sandbox user may not be able to read this file.
# argv: control fd, timeout, rlimits "NAME=soft:hard,...", keyctl's syscall number, fd of the code's source,
#       tmpfs "path:bytes:inodes:mode,...", ptys, sysctls "user/name=value,...", seccomp filter (hex), command...
RUNNER = r"""
import ctypes, errno, os, resource, select, signal, sys
if os.getpid() != 1:  # kill(-1) below would reach every process this user has outside a PID namespace
    sys.exit("sandbox: the runner is not PID 1 of a new PID namespace; refusing to run")
libc = ctypes.CDLL(None, use_errno=True)

def checked(what, result):
    if result < 0:
        sys.exit(f"sandbox: the runner cannot {what}: {os.strerror(ctypes.get_errno())}")

# PR_SET_DUMPABLE 0: the code runs as the same user, and could otherwise ptrace its runner (stop
# it, or make it report another status). exec resets this for the code itself.
libc.prctl(4, 0)
control, timeout, limits, keyctl = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
source, tmpfs, ptys, sysctls, program = int(sys.argv[5]), *sys.argv[6:10]
command = sys.argv[10:]
code = b""
while chunk := os.read(source, 1 << 20):
    code += chunk
os.close(source)
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
checked("make a mount namespace", libc.unshare(0x00020000))  # CLONE_NEWNS: one the call's user namespace owns
for item in tmpfs.split(","):
    path, size, inodes, mode = item.split(":")
    options = f"size={size},nr_inodes={inodes},mode={mode}".encode()
    checked(f"mount {path}", libc.mount(b"tmpfs", path.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV),
                                        options))
with open(os.open("/work/main.py", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644), "wb") as f:
    f.write(code)
os.chdir("/work")
checked("mount /dev/pts", libc.mount(b"devpts", b"/dev/pts", b"devpts", ctypes.c_ulong(MS_NOSUID | MS_NOEXEC),
                                     f"newinstance,ptmxmode=0666,mode=0620,max={ptys}".encode()))
for item in sysctls.split(","):  # this user namespace's own limits: a share of the host's, per call
    name, value = item.split("=")
    try:
        with open(f"/proc/sys/{name}", "w") as f:
            f.write(value)
    except FileNotFoundError:  # an older kernel without this limit
        pass
checked("bind /proc/sys", libc.mount(b"/proc/sys", b"/proc/sys", None, ctypes.c_ulong(MS_BIND), None))
checked("make /proc/sys read-only", libc.mount(None, b"/proc/sys", None, ctypes.c_ulong(
    MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC), None))
# KEYCTL_JOIN_SESSION_KEYRING, NULL: a fresh, empty session keyring, so the trainer's (its keys, or a value one
# call leaves for the next) is out of reach; the seccomp filter refuses the code every key call.
if libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(1), ctypes.c_long(0)) < 0 and ctypes.get_errno() != errno.ENOSYS:
    sys.exit(f"sandbox: cannot join a fresh session keyring: {os.strerror(ctypes.get_errno())}")
# No capability from here on, for the runner and all it starts: the ambient set cleared, then every set emptied
# (the uid is not 0, so nothing comes back on exec), and no_new_privs (no setuid or file capabilities either).
checked("clear the ambient capabilities", libc.prctl(47, 4, 0, 0, 0))  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
checked("drop capabilities", libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)()))
checked("set no_new_privs", libc.prctl(38, 1, 0, 0, 0))
filter_ = ctypes.create_string_buffer(bytes.fromhex(program))
class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
checked("load the seccomp filter", libc.prctl(22, 2, ctypes.byref(Program(len(filter_.raw) // 8,  # PR_SET_SECCOMP,
                                              ctypes.addressof(filter_))), 0, 0))  # SECCOMP_MODE_FILTER
# As init, with the default handler a signal from inside the namespace is simply not delivered,
# so the code cannot interrupt its runner.
signal.signal(signal.SIGINT, signal.SIG_DFL)
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
# Readable control socket: the parent sent "stop" (output over the limit) or closed it (cancelled, or gone).
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


def tell_stop(control: socket.socket) -> None:
    """Ask the runner to kill the code now and report (unlike closing the socket, which is a cancellation)."""
    try:
        control.send(b"stop")
    except OSError:
        pass  # the runner has already gone: there is nothing left to stop


def receive_report(control: socket.socket) -> tuple[int, bool] | None:
    """The runner's report (`wait status`, `timed out`), sent before it exited; None if it sent none."""
    control.setblocking(False)
    try:
        status, timed_out = control.recv(64).decode().split()
    except (BlockingIOError, ValueError):
        return None
    return int(status), timed_out == "1"
