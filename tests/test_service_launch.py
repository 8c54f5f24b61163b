"""``tangram.service.launch``: ``tangram serve`` as a real subprocess, started, failed and stopped."""
from __future__ import annotations

import json
import os
import tempfile
import threading
import urllib.request
from pathlib import Path

import pytest

from tangram.service.launch import ServeStartError, start_serve

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)
NODE = {"cpu_nodes": [{"name": "here", "executor": "local", "cores": 1, "memory_mb": 256}], "gpu_nodes": []}


@pytest.fixture
def temp_root(tmp_path, monkeypatch) -> Path:
    """Where ``tempfile`` makes directories during the test (so leftovers can be seen)."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root


def _live_children() -> list[int]:
    """This process's children that are not zombies."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.append(int(d))
    return out


def _output_readers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("tangram-serve-")]


def test_start_serve_returns_once_listening_and_stop_leaves_nothing(tmp_path):
    cfg = tmp_path / "cluster.json"
    cfg.write_text(json.dumps(NODE))
    with start_serve(["--config", cfg, "--port", "0", "--no-auth"], cwd=REPO, throwaway_state=True) as srv:
        assert srv.url is not None and srv.url.startswith("http://127.0.0.1:")
        with urllib.request.urlopen(f"{srv.url}/healthz", timeout=10) as r:
            assert json.load(r)["status"] == "ok"
        assert srv.wait_for_output("state in ")  # printed after the listening line: still read
        state = srv.output().split("state in ", 1)[1].split()[0]
        assert os.path.isdir(state) and os.path.basename(state).startswith("tangram-state-")
        pid = srv.pid
    assert srv.proc.returncode == 0  # SIGTERM: a clean shutdown
    assert pid not in _live_children()
    assert not os.path.exists(state)  # the throwaway state directory is removed
    assert srv.stop() == 0  # idempotent
    assert not _output_readers()


def test_an_early_exit_raises_with_its_output(tmp_path, temp_root):
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"cpu_nodes": [{"name": "a", "executor": "local", "cores": 1, "memory_mb": -1}]}))
    with pytest.raises(ServeStartError) as e:
        start_serve(["--config", cfg, "--port", "0", "--no-auth"], cwd=REPO, throwaway_state=True, wait_s=60)
    assert e.value.returncode == 2
    assert "config error" in e.value.output and "cpu_nodes[0].memory_mb" in e.value.output
    assert "cpu_nodes[0].memory_mb" in str(e.value)  # the message carries the reason, not only the attribute
    assert not _output_readers() and not _live_children()
    assert not os.listdir(temp_root)  # its throwaway state directory is gone too


def test_a_service_that_does_not_listen_in_time_is_killed(tmp_path, temp_root):
    cfg = tmp_path / "cluster.json"
    cfg.write_text(json.dumps(NODE))
    # an interpreter's start alone takes longer than this
    with pytest.raises(ServeStartError) as e:
        start_serve(["--config", cfg, "--port", "0", "--no-auth"], cwd=REPO, throwaway_state=True, wait_s=0.05)
    assert e.value.returncode is None and "did not listen within 0.05 s" in str(e.value)
    assert not _output_readers() and not _live_children()
    assert not os.listdir(temp_root)


def test_state_dir_and_throwaway_state_are_exclusive(tmp_path):
    with pytest.raises(ValueError):
        start_serve([], state_dir=tmp_path, throwaway_state=True)


def test_the_whole_output_is_kept_when_asked_and_a_missing_text_is_not_waited_for_past_the_end(tmp_path):
    cfg = tmp_path / "cluster.json"
    cfg.write_text(json.dumps(NODE))
    with start_serve(["--config", cfg, "--port", "0", "--no-auth"], cwd=REPO, throwaway_state=True,
                     tail_lines=None) as srv:
        assert srv.wait_for_output("state in ")
    assert "--no-auth: no bearer token" in srv.output()  # stderr's warning, kept with stdout
    assert f"tangram serve: listening on {srv.url}\n" in srv.output()
    assert not srv.wait_for_output("never printed", timeout_s=30)  # its output has ended: False at once
