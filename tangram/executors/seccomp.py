"""The local sandbox's system-call filter: a seccomp BPF program bubblewrap loads (``bwrap --seccomp FD``).

Built once per process with libseccomp (through ``pyseccomp``, its ctypes
binding; the system's ``libseccomp.so.2``), never hand-assembled. Allow by
default; these calls fail with ``EPERM`` (the parts of Docker's default
profile that matter for a sandboxed user without capabilities, whose
namespaces bubblewrap already made):

* new namespaces and joining others: ``unshare``, ``setns``, ``clone`` with
  any ``CLONE_NEW*`` flag (``clone3`` answers ``ENOSYS``: its flags sit in
  memory a filter cannot read, and libc falls back to ``clone``);
* the mount API, old and new: ``mount``, ``umount2``, ``pivot_root``,
  ``fsopen``, ``fsmount``, ``fsconfig``, ``fspick``, ``move_mount``,
  ``open_tree``, ``mount_setattr``;
* the kernel's own surface: ``bpf``, ``perf_event_open``, ``userfaultfd``,
  ``kexec_*``, modules, ``keyctl`` / ``add_key`` / ``request_key``,
  ``open_by_handle_at``, ``iopl`` / ``ioperm``, ``syslog``, ``acct``,
  ``quotactl``, ``swapon`` / ``swapoff``, ``reboot``, clock setters,
  ``lookup_dcookie``, ``vhangup``.

System calls of another architecture (a 32-bit binary's ``int 0x80``) kill
the process: libseccomp's default for a foreign architecture.

Without ``pyseccomp`` or ``libseccomp.so.2`` :func:`program` returns None
and says why (:func:`unavailable`); the sandbox then runs without the filter
and the executor warns once at start.
"""
from __future__ import annotations

import errno
import functools
import os

DENIED = (
    "unshare", "setns",
    "mount", "umount2", "pivot_root", "fsopen", "fsmount", "fsconfig", "fspick", "move_mount", "open_tree",
    "mount_setattr",
    "bpf", "perf_event_open", "userfaultfd", "kexec_load", "kexec_file_load", "init_module", "finit_module",
    "delete_module", "keyctl", "add_key", "request_key", "open_by_handle_at", "iopl", "ioperm", "syslog", "acct",
    "quotactl", "swapon", "swapoff", "reboot", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "lookup_dcookie", "vhangup",
)
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME (linux/sched.h)
CLONE_NEW_ANY = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000 | 0x00000080


@functools.lru_cache(maxsize=1)
def _build() -> tuple[bytes | None, str]:
    try:
        import pyseccomp as sc

        f = sc.SyscallFilter(defaction=sc.ALLOW)
        for name in DENIED:
            try:
                f.add_rule(sc.ERRNO(errno.EPERM), name)
            except (ValueError, RuntimeError, OSError):  # a call this kernel/libseccomp does not know
                continue
        for bit in range(32):  # one rule per namespace flag: any of them set is refused
            if CLONE_NEW_ANY >> bit & 1:
                f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, 1 << bit, 1 << bit))
        try:
            f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        except (ValueError, RuntimeError, OSError):
            pass
        fd = os.memfd_create("tangram-seccomp")
        try:
            with os.fdopen(os.dup(fd), "wb") as out:
                f.export_bpf(out)
            os.lseek(fd, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(fd, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(fd)
        return b"".join(chunks), ""
    except Exception as exc:  # noqa: BLE001 - no binding, no libseccomp.so.2, an old kernel: no filter, said why
        return None, f"{type(exc).__name__}: {exc}"


def program() -> bytes | None:
    """The compiled BPF program (bytes), or None when it cannot be built here."""
    return _build()[0]


def unavailable() -> str | None:
    """Why there is no filter (None: there is one)."""
    prog, why = _build()
    return None if prog is not None else why


def pipe_args() -> tuple[list[int], list[str]]:
    """A pipe holding the program and bwrap's ``--seccomp FD`` (pass the fd to the child, close it after);
    nothing when no filter can be built."""
    prog = program()
    if prog is None:
        return [], []
    r, w = os.pipe()
    try:
        os.write(w, prog)  # a few KiB: fits the pipe's buffer, never blocks
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return [r], ["--seccomp", str(r)]
