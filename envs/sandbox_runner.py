"""The sandbox's runner (used by `envs.sandbox`): the program PID 1 of each call's namespaces runs, and the
control socket between it and the trainer."""

from __future__ import annotations

import socket

# PID 1 of the sandbox's namespaces: starts the code with its limits, enforces the wall clock,
# then kills and reaps everything and sends the code's wait status back on the control socket.
# A string for `python -c` because the sandbox user may not be able to read this file.
# argv: control fd, timeout, limits "NAME=soft:hard,...", keyctl's syscall number, command...
RUNNER = r"""
import ctypes, errno, os, resource, select, signal, sys
if os.getpid() != 1:  # kill(-1) below would reach every process this user has outside a PID namespace
    sys.exit("sandbox: the runner is not PID 1 of a new PID namespace; refusing to run")
libc = ctypes.CDLL(None, use_errno=True)
# PR_SET_DUMPABLE 0: the code runs as the same user, and could otherwise ptrace its runner (stop
# it, or make it report another status). exec resets this for the code itself.
libc.prctl(4, 0)
control, timeout, limits, keyctl = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
command = sys.argv[5:]
# KEYCTL_JOIN_SESSION_KEYRING, NULL: a fresh, empty session keyring, so the trainer's (its keys, or a value one
# call leaves for the next) is out of reach; the seccomp filter refuses the code every other key call.
if libc.syscall(ctypes.c_long(keyctl), ctypes.c_long(1), ctypes.c_long(0)) < 0 and ctypes.get_errno() != errno.ENOSYS:
    sys.exit(f"sandbox: cannot join a fresh session keyring: {os.strerror(ctypes.get_errno())}")
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
