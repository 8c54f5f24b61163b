"""Errors that name the offending field and the reason.

"Does not fit now" is never an exception (it is a value in the policy);
these are for input that is wrong or can never be served.
"""
from __future__ import annotations


class TangramError(Exception):
    """Base class of every error raised on purpose by tangram."""


class FieldError(TangramError, ValueError):
    """Input that is wrong, naming the offending ``field`` (a dotted path) and the ``reason``.

    Every error that points at one field of a request, a config file or a
    data file is one of these, so callers (the HTTP layer, the CLI) report
    them all the same way.
    """

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")

    def __reduce__(self):
        # rebuilt from its own arguments: the default (the class called with the message alone)
        # fails in the process that unpickles it, and a multiprocessing pool whose worker raised
        # one then waited for ever
        return type(self), (self.field, self.reason), self.__dict__


class DemandError(FieldError):
    """An action (or one of its fields) is malformed."""


class ConfigError(FieldError):
    """A configuration file or section is malformed (``field`` is its path: ``cpu_nodes[1].cores``)."""


class UnschedulableError(DemandError):
    """A well-formed demand that no node of the cluster can ever satisfy."""


class UnavailableError(UnschedulableError):
    """A demand that cannot be served now but may be soon (its node is down): retry after ``retry_after_s``."""

    def __init__(self, field: str, reason: str, retry_after_s: int = 1):
        super().__init__(field, reason)
        self.retry_after_s = int(retry_after_s)

    def __reduce__(self):
        return type(self), (self.field, self.reason, self.retry_after_s), self.__dict__


class UnknownActionError(TangramError, KeyError):
    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else "unknown action"


def invariant(ok: object, message: str) -> None:
    """Raise ``AssertionError(message)`` unless ``ok``: a bare ``assert`` is removed by ``python -O``."""
    if not ok:
        raise AssertionError(message)
