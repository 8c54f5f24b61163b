"""What the Docker executor reads of the engine's errors, and how it feeds an exec's stdin and quiets a kill."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("tangram.executors.docker")


def quiet(f: asyncio.Future) -> None:  # a kill's own failure is logged, never left unretrieved
    f.cancelled() or f.exception() is None or log.warning("docker executor: a kill failed: %r", f.exception())


def send_and_close(sock: Any, data: bytes) -> None:
    """Write an exec's stdin, then half-close: the command reads EOF, its output keeps flowing back."""
    import socket

    try:
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the command ended or closed its stdin first: what it read is what it gets


def engine_lost(e: BaseException) -> bool:
    """The engine could not be reached or dropped the call (vs. an answer refusing it): not the command's fault."""
    import docker

    if isinstance(e, docker.errors.APIError):  # it answered; a lost exec means it restarted under it
        return e.status_code == 404 and "no such exec" in str(e.explanation or "").lower()
    return isinstance(e, (OSError, docker.errors.DockerException)) or type(e).__module__.startswith(
        ("requests", "urllib3"))


def why(e: BaseException) -> str:
    return getattr(e, "explanation", None) or f"{type(e).__name__}: {e}"
