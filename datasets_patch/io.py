"""Read and write datasets as lists of dict records: JSONL, JSON (a list), Parquet.

The format follows the file extension; an unknown extension is sniffed from the
content. Parquet keeps its schema: columns and struct children we add are
appended with their inferred types, everything else keeps its original type.
Writes are atomic (a temporary file renamed into place), so OUT may be IN.
"""
from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from typing import Any

from datasets_patch.jsonvalues import json_default
from tangram.core.atomic_file import replace_atomically

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
           ".pq": "parquet"}


class DatasetError(Exception):
    """A dataset file cannot be read or written; the message names file and reason."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass
class Dataset:
    records: list[dict]
    fmt: str
    schema: Any = None  # pyarrow schema of a Parquet input
    indent: int | None = None  # JSON input was pretty-printed


def format_of(path: str, sniff: bool = True) -> str:
    ext = os.path.splitext(path)[1].lower()
    if ext in FORMATS:
        return FORMATS[ext]
    if not sniff:
        raise DatasetError(path, f"unknown extension {ext!r}; use .jsonl, .json or .parquet")
    try:
        with open(path, "rb") as fh:
            head = fh.read(64).lstrip()
    except OSError as exc:
        raise DatasetError(path, exc.strerror or str(exc)) from exc
    if head.startswith(b"PAR1"):
        return "parquet"
    if head.startswith(b"["):
        return "json"
    if head.startswith(b"{"):
        return "jsonl"
    raise DatasetError(path, f"unknown extension {ext!r} and content is not JSON, JSONL or Parquet")


def read_dataset(path: str) -> Dataset:
    if not os.path.exists(path):
        raise DatasetError(path, "no such file")
    if os.path.isdir(path):
        raise DatasetError(path, "is a directory, expected a file")
    fmt = format_of(path)
    try:
        if fmt == "parquet":
            return _read_parquet(path)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except DatasetError:
        raise
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(path, f"cannot read: {exc}") from exc
    # a list named .jsonl is read as JSON (JSONL named .json: see _parse_json)
    if fmt == "jsonl" and text.lstrip().startswith("["):
        fmt = "json"
    if fmt == "json":
        return _parse_json(path, text)
    return _parse_jsonl(path, text)


def _parse_json(path: str, text: str) -> Dataset:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data" and text.lstrip().startswith("{"):
            return _parse_jsonl(path, text)  # one object per line, named .json
        raise DatasetError(path, f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
    if not isinstance(data, list):
        raise DatasetError(path, f"expected a JSON list of records, got {type(data).__name__}")
    for i, rec in enumerate(data):
        if not isinstance(rec, dict):
            raise DatasetError(path, f"record {i} is {type(rec).__name__}, expected an object")
    indent = 2 if text.lstrip().startswith("[\n") or text.lstrip().startswith("[\r\n") else None
    return Dataset(data, "json", indent=indent)


def _parse_jsonl(path: str, text: str) -> Dataset:
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(path, f"line {lineno}: invalid JSON ({exc.msg})") from exc
        if not isinstance(rec, dict):
            raise DatasetError(path, f"line {lineno}: expected a JSON object, got {type(rec).__name__}")
        records.append(rec)
    return Dataset(records, "jsonl")


def _read_parquet(path: str) -> Dataset:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # the [datasets] extra is missing
        raise DatasetError(path, "reading Parquet needs pyarrow (pip install 'arl-tangram[datasets]')") from exc
    try:
        table = pq.read_table(path)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
        raise DatasetError(path, f"not a readable Parquet file: {exc}") from exc
    return Dataset(table.to_pylist(), "parquet", schema=table.schema)


def write_dataset(path: str, ds: Dataset, fmt: str | None = None) -> None:
    """Write ``ds`` to ``path`` atomically (``tangram.core.atomic_file``): a failed or interrupted
    write leaves it as it was, so OUT may safely be IN; a symlinked OUT keeps its link, and OUT
    keeps its mode.
    """
    fmt = fmt or ds.fmt
    target = os.path.realpath(path)
    folder = os.path.dirname(target)
    if os.path.isdir(target):
        raise DatasetError(path, "is a directory, expected a file")
    if not os.path.isdir(folder):
        raise DatasetError(path, f"cannot write: directory {folder} does not exist")
    try:
        replace_atomically(path, lambda fh: _write_to(fh, ds, fmt, path))
    except OSError as exc:
        raise DatasetError(path, f"cannot write: {exc.strerror or exc}") from exc
    except (TypeError, ValueError, NotImplementedError) as exc:
        raise DatasetError(path, f"cannot write: {exc}") from exc


def _write_to(fh, ds: Dataset, fmt: str, path: str) -> None:
    if fmt == "parquet":
        _write_parquet(fh, ds, path)
        return
    text = io.TextIOWrapper(fh, encoding="utf-8", write_through=True)
    try:
        if fmt == "json":
            json.dump(ds.records, text, ensure_ascii=False, indent=ds.indent, default=json_default)
            text.write("\n")
        else:
            for rec in ds.records:
                text.write(json.dumps(rec, ensure_ascii=False, default=json_default) + "\n")
        text.flush()
    finally:
        text.detach()  # the caller closes fh


def _write_parquet(fh, ds: Dataset, path: str) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # the [datasets] extra is missing
        raise DatasetError(path, "writing Parquet needs pyarrow (pip install 'arl-tangram[datasets]')") from exc

    try:
        inferred = pa.Table.from_pylist(ds.records).schema if ds.records else None
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        inferred = None
    schema = ds.schema
    if schema is None:
        schema = inferred
    elif inferred is not None:
        schema = _merge_schema(schema, inferred)
    if schema is None:
        raise DatasetError(path, "no records and no schema to write")
    table = pa.Table.from_pylist(ds.records, schema=schema)
    pq.write_table(table, fh)


def _merge_schema(orig, inferred):
    """``orig`` with the fields only ``inferred`` has appended (struct children too)."""
    import pyarrow as pa

    fields = []
    by_name = {f.name: f for f in inferred}
    for f in orig:
        if f.name in by_name:
            f = f.with_type(_merge_type(f.type, by_name[f.name].type))
        fields.append(f)
    names = set(orig.names)
    fields += [f for f in inferred if f.name not in names]
    metadata = dict(orig.metadata or {})
    if len(fields) != len(orig) or any(a.type != b.type for a, b in zip(fields, orig)):
        # HF `datasets` trusts its stored feature list over the columns
        metadata.pop(b"huggingface", None)
    return pa.schema(fields, metadata=metadata or None)


def _merge_type(orig, inferred):
    import pyarrow as pa

    if pa.types.is_struct(orig) and pa.types.is_struct(inferred):
        new_children = {inferred.field(i).name: inferred.field(i) for i in range(inferred.num_fields)}
        children = []
        for i in range(orig.num_fields):
            child = orig.field(i)
            if child.name in new_children:
                child = child.with_type(_merge_type(child.type, new_children[child.name].type))
            children.append(child)
        have = {c.name for c in children}
        children += [c for n, c in new_children.items() if n not in have]
        return pa.struct(children)
    return orig
