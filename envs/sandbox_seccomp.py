"""The sandbox's seccomp filter (used by `envs.sandbox`): a classic BPF program that the runner loads once it has set
the call up and dropped its capabilities, before the code starts, so it binds the runner, the code and every
child, and cannot be lifted.

It refuses (EPERM) the system calls untrusted code has no use for and that reach state shared with the host or
the kernel's less-trodden paths: the key store (keyctl, add_key, request_key: the runner has joined a fresh,
empty session keyring before), io_uring and Linux AIO (io_setup: its events are counted for the whole host),
new namespaces (unshare, setns, and clone with a CLONE_NEW* flag), mounting (mount and the new mount API,
pivot_root, chroot), memory no rlimit counts (memfd_create/memfd_secret, and SysV shared memory, message queues
and semaphores: shmget, msgget, semget), bpf, perf_event_open, userfaultfd, ptrace and process_vm_*, and
module, kexec, swap, reboot, syslog, acct and quota calls. clone3 gets ENOSYS: its flags are out of the filter's sight,
and glibc falls back to clone, whose flags it checks. Calls of another ABI (x86's 32-bit int 0x80, x32) get
ENOSYS, so they cannot slip past the numbers below.

Written once here, without libseccomp, for the two architectures these jobs run on; the numbers are the
kernel's (checked against its headers by tests/envs/test_sandbox.py where they are installed).
"""

from __future__ import annotations

import errno
import os
import struct

# (AUDIT_ARCH_*, syscall numbers by name) per `os.uname().machine`; aarch64 uses the kernel's generic table.
_X86_64 = {
    "keyctl": 250, "add_key": 248, "request_key": 249, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "unshare": 272, "setns": 308, "mount": 165, "umount2": 166, "pivot_root": 155,
    "chroot": 161, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "bpf": 321, "perf_event_open": 298, "userfaultfd": 323,
    "kexec_load": 246, "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "open_by_handle_at": 304, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
    "pidfd_getfd": 438, "swapon": 167, "swapoff": 168, "reboot": 169, "syslog": 103, "acct": 163,
    "quotactl": 179, "quotactl_fd": 443, "lookup_dcookie": 212, "vhangup": 153, "memfd_create": 319,
    "memfd_secret": 447, "iopl": 172, "ioperm": 173, "uselib": 134, "clone": 56, "clone3": 435,
    "io_setup": 206, "shmget": 29, "msgget": 68, "semget": 64,
}
_AARCH64 = {
    "keyctl": 219, "add_key": 217, "request_key": 218, "io_uring_setup": 425, "io_uring_enter": 426,
    "io_uring_register": 427, "unshare": 97, "setns": 268, "mount": 40, "umount2": 39, "pivot_root": 41,
    "chroot": 51, "move_mount": 429, "open_tree": 428, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "bpf": 280, "perf_event_open": 241, "userfaultfd": 282,
    "kexec_load": 104, "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
    "open_by_handle_at": 265, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
    "pidfd_getfd": 438, "swapon": 224, "swapoff": 225, "reboot": 142, "syslog": 116, "acct": 89,
    "quotactl": 60, "quotactl_fd": 443, "lookup_dcookie": 18, "vhangup": 58, "memfd_create": 279,
    "memfd_secret": 447, "clone": 220, "clone3": 435, "io_setup": 0, "shmget": 194, "msgget": 186, "semget": 190,
}
ARCHES = {"x86_64": (0xC000003E, _X86_64), "aarch64": (0xC00000B7, _AARCH64)}
SPECIAL = ("clone", "clone3")  # filtered on their arguments, not refused outright
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET (not NEWTIME, 0x80: clone's exit signal)
CLONE_NEW_NAMESPACES = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
X32_SYSCALL_BIT = 0x40000000

# Classic BPF, as seccomp runs it over struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}.
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
NR, ARCH = 0, 4


def _arg(index: int) -> int:
    """Offset of the low 32 bits of syscall argument `index` (little-endian machines)."""
    return 16 + 8 * index


def syscall_numbers(machine: str | None = None) -> dict[str, int]:
    """The numbers the filter uses on `machine` (default: this one); ValueError where it has none."""
    machine = machine or os.uname().machine
    if machine not in ARCHES:
        raise ValueError(f"sandbox has no seccomp filter for {machine!r} (only {', '.join(ARCHES)}): run the "
                         "sandbox on one of those")
    return ARCHES[machine][1]


def build_filter(machine: str | None = None) -> bytes:
    """The filter for `machine` (default: this one), as the bytes of a `struct sock_filter` array."""
    machine = machine or os.uname().machine
    numbers = syscall_numbers(machine)
    audit_arch = ARCHES[machine][0]
    program = [(LD_ABS, 0, 0, ARCH), (JEQ, 0, "enosys", audit_arch), (LD_ABS, 0, 0, NR)]
    if machine == "x86_64":
        program.append((JGE, "enosys", 0, X32_SYSCALL_BIT))
    program += [(JEQ, "clone", 0, numbers["clone"]), (JEQ, "enosys", 0, numbers["clone3"])]
    program += [(JEQ, "eperm", 0, number) for name, number in sorted(numbers.items()) if name not in SPECIAL]
    program.append((RET, 0, 0, RET_ALLOW))
    labels = {"clone": len(program)}
    program += [(LD_ABS, 0, 0, _arg(0)), (JSET, "eperm", "allow", CLONE_NEW_NAMESPACES)]
    labels.update(allow=len(program), eperm=len(program) + 1, enosys=len(program) + 2)
    program += [(RET, 0, 0, RET_ALLOW), (RET, 0, 0, RET_ERRNO | errno.EPERM), (RET, 0, 0, RET_ERRNO | errno.ENOSYS)]

    def offset(target, at: int) -> int:
        return target if isinstance(target, int) else labels[target] - at - 1

    return b"".join(struct.pack("=HBBI", code, offset(jt, i), offset(jf, i), k)
                    for i, (code, jt, jf, k) in enumerate(program))
