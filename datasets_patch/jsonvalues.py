"""JSON for values Parquet rows hold but ``json`` cannot write.

``pyarrow`` turns timestamp, date, time, duration, decimal and binary columns
into Python objects; written as JSON they become (mostly) strings:

- datetime, date, time: ISO 8601 (``2024-01-02T03:04:05+00:00``), as pandas'
  ``to_json(date_format="iso")`` does;
- timedelta: seconds as a number (``90.5``);
- Decimal: its exact digits as a string (``"12.50"``), so no precision is lost;
- bytes: the text if it is valid UTF-8 (most binary columns hold text), else
  base64. Text round-trips exactly; reading back cannot tell base64 from text.
"""
from __future__ import annotations

import base64
import datetime
import decimal
from typing import Any


def json_default(value: Any) -> Any:
    """``default=`` for ``json.dump``: a JSON-able stand-in, or TypeError naming the type."""
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes_to_text(bytes(value))
    raise TypeError(f"a value of type {type(value).__name__} cannot be written as JSON")


def bytes_to_text(value: bytes) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return base64.b64encode(value).decode("ascii")


def display_default(value: Any) -> Any:
    """``default=`` for reports: as ``json_default``, else ``str``; a summary must never fail."""
    try:
        return json_default(value)
    except TypeError:
        return str(value)
