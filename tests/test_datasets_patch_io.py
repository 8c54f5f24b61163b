"""datasets_patch: atomic writes, Parquet values in JSON, binary and malformed commands."""
from __future__ import annotations

import datetime
import decimal
import json
import os

import pytest

from datasets_patch.io import Dataset, DatasetError, write_dataset
from datasets_patch.rewrite import patch_script
from tangram.cli import main as tangram_main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

P = "${parallel_num}"
OLD = '{"keep": "me"}\n'


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_failed_write_leaves_out_intact(tmp_path):
    dst = tmp_path / "out.jsonl"
    dst.write_text(OLD)
    ds = Dataset([{"test_cmd": "pytest"}, {"odd": object()}], "jsonl")
    with pytest.raises(DatasetError, match="cannot write"):
        write_dataset(str(dst), ds)
    assert dst.read_text() == OLD  # not truncated
    assert _leftovers(tmp_path) == []


def test_interrupted_write_leaves_out_intact(tmp_path, monkeypatch):
    def interrupt(value):
        raise KeyboardInterrupt

    monkeypatch.setattr("datasets_patch.io.json_default", interrupt, raising=False)
    dst = tmp_path / "out.json"
    dst.write_text(OLD)
    with pytest.raises(KeyboardInterrupt):
        write_dataset(str(dst), Dataset([{"a": 1}, {"b": object()}], "json"))
    assert dst.read_text() == OLD
    assert _leftovers(tmp_path) == []


def test_in_place_keeps_mode_and_symlink(tmp_path, capsys):
    src = tmp_path / "data.jsonl"
    src.write_text('{"test_cmd": "pytest -rA"}\n')
    os.chmod(src, 0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(src.name)
    assert tangram_main(["patch-dataset", str(link), str(link)]) == 0
    assert link.is_symlink()
    assert json.loads(src.read_text())["test_cmd"] == f"pytest -n {P} -rA"
    assert src.stat().st_mode & 0o777 == 0o640
    assert _leftovers(tmp_path) == []


def test_new_out_gets_umask_mode(tmp_path, capsys):
    src, dst = tmp_path / "in.jsonl", tmp_path / "new.jsonl"
    src.write_text('{"test_cmd": "pytest"}\n')
    umask = os.umask(0o022)
    try:
        assert tangram_main(["patch-dataset", str(src), str(dst)]) == 0
    finally:
        os.umask(umask)
    assert dst.stat().st_mode & 0o777 == 0o644  # not the 0o600 of a private temp file


def test_missing_out_folder_is_a_clear_error(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text('{"test_cmd": "pytest"}\n')
    assert tangram_main(["patch-dataset", str(src), str(tmp_path / "no" / "out.jsonl")]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_parquet_values_to_jsonl(tmp_path, capsys):
    when = datetime.datetime(2024, 1, 2, 3, 4, 5, tzinfo=datetime.timezone.utc)
    row = {"test_cmd": "pytest -rA", "created_at": when, "day": datetime.date(2024, 1, 2),
           "at": datetime.time(3, 4, 5), "took": datetime.timedelta(seconds=90, microseconds=500000),
           "price": decimal.Decimal("12.50"), "text": b"hi \xc3\xa9", "blob": b"\xff\x00"}
    src, dst = tmp_path / "in.parquet", tmp_path / "out.jsonl"
    pq.write_table(pa.Table.from_pylist([row]), src)
    dst.write_text(OLD)
    assert tangram_main(["patch-dataset", str(src), str(dst)]) == 0
    out = json.loads(dst.read_text())
    assert out["test_cmd"] == f"pytest -n {P} -rA"
    assert out["created_at"] == "2024-01-02T03:04:05+00:00"
    assert (out["day"], out["at"], out["took"]) == ("2024-01-02", "03:04:05", 90.5)
    assert out["price"] == "12.50"
    assert out["text"] == "hi \u00e9"  # valid UTF-8: the text
    assert out["blob"] == "/wA="  # anything else: base64


def test_binary_command_is_skipped_with_reason(tmp_path, capsys):
    src, dst, rep = tmp_path / "in.parquet", tmp_path / "out.parquet", tmp_path / "report.json"
    table = pa.table({"repo": ["a/b"], "test_cmd": pa.array([b"pytest -rA"], pa.binary())})
    pq.write_table(table, src)
    assert tangram_main(["patch-dataset", str(src), "--dry-run"]) == 0
    assert "holds bytes" in capsys.readouterr().out
    assert tangram_main(["patch-dataset", str(src), str(dst), "--report", str(rep)]) == 0
    assert "holds bytes" in capsys.readouterr().out
    assert pq.read_table(dst).to_pylist() == [{"repo": "a/b", "test_cmd": b"pytest -rA"}]
    example = json.loads(rep.read_text())["examples"]["no_test_command"][0]
    assert example["before"] == "pytest -rA"


@pytest.mark.parametrize("command", [
    "pytest tests -n", "pytest -n", "pytest --numprocesses", "pytest -n -x tests",
    "pytest -n -- tests", "pytest -n=", "pytest -n 4 -n", "pytest -n; echo done",
])
def test_count_option_without_value_is_left_alone(command):
    res = patch_script(command)
    assert res.text == command  # pytest rejects it; an edit would hide or drop words
    assert res.outcome == "unsupported_runner"
    assert [i.runner for i in res.invocations] == ["pytest (-n without a value)"]


def test_count_option_values_still_replaced():
    assert patch_script("pytest -n -1 x").text == f"pytest -n {P} x"  # a value, if odd
    assert patch_script("pytest -- -n").text == f"pytest -n {P} -- -n"  # after --: a test id
