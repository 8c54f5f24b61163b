"""Replace a file atomically: a reader sees the old file or the new one, never half of one.

One writer for every file the project rewrites in place (the profile store, a patched
dataset), so each keeps the same promises: the temporary file sits beside the target (a
rename never crosses filesystems), is on disk before the rename, and is removed on any
error or interrupt, leaving the target as it was.
"""
from __future__ import annotations

import contextlib
import os
import secrets
import stat
from typing import BinaryIO, Callable


def replace_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None], *, new_mode: int = 0o666) -> None:
    """Write ``path`` through ``write`` (handed a binary file) into a temporary file beside it, then
    rename that over ``path``.

    A symlinked ``path`` has its target replaced and keeps the link. The file keeps its permission
    bits; a new one gets ``new_mode`` less the umask (as ``open(path, "w")`` would, not the 0600 of
    a private temporary file). Errors propagate as raised, the temporary file removed first.
    """
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    tmp = os.path.join(folder, f".{os.path.basename(target)}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, new_mode)  # the umask applies here
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            os.fsync(fh.fileno())
        with contextlib.suppress(FileNotFoundError):
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))  # a rewrite keeps the file's mode
        os.replace(tmp, target)
    except BaseException:  # Ctrl-C too: never leave the temporary file behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
