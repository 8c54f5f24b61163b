"""Shared pytest fixtures.  Keep this file tidy: one section per resource."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------
# Optional dependencies: a skip that names what to install, or under CI=true
# (where scripts/test.sh installed everything) a failure
# --------------------------------------------------------------------------
_importorskip = pytest.importorskip


def _importorskip_or_fail(modname: str, minversion: str | None = None, reason: str | None = None, **kw):
    """``pytest.importorskip`` for every test module, via :func:`tests.helpers.missing` when it is absent."""
    from tests.helpers import install_hint, missing

    try:
        return _importorskip(modname, minversion, reason, **kw)
    except pytest.skip.Exception as exc:
        missing(modname, reason or install_hint(modname), detail=str(exc))


pytest.importorskip = _importorskip_or_fail


# --------------------------------------------------------------------------
# Durable state: `tangram serve` keeps it under ~/.local/state/tangram/<nodes' key> unless told
# otherwise; every test gets a directory of its own (made by the service if it needs one), so
# services of different tests never share, nor find each other's environments
# --------------------------------------------------------------------------
@pytest.fixture(scope="session", autouse=True)
def _no_state_in_home(tmp_path_factory):
    """Services a module-scoped fixture starts (before the per-test directory below is set) keep their
    default state under the session's temporary directory, never in the user's home."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.getbasetemp() / "xdg-state"))
    yield
    mp.undo()


@pytest.fixture(autouse=True)
def _own_state_dir(tmp_path_factory, monkeypatch):
    import uuid

    monkeypatch.setenv("TANGRAM_STATE_DIR", str(tmp_path_factory.getbasetemp() / f"state-{uuid.uuid4().hex[:12]}"))


# --------------------------------------------------------------------------
# verl integration: its guard counts a process's failed calls to the service (and stops the run at
# max_consecutive_failures); every test starts from none, whatever dead ports earlier tests called
# --------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def _fresh_service_guard():
    import sys

    guard = sys.modules.get("integrations.verl.guard")
    if guard is not None:
        guard.reset(actor=False)


# --------------------------------------------------------------------------
# Docker Engine
# --------------------------------------------------------------------------
def _start_docker_engine() -> str:
    """Run scripts/docker_engine.sh once (root only); return its output tail."""
    script = REPO_ROOT / "scripts" / "docker_engine.sh"
    if not script.exists():
        return f"{script} missing"
    if os.geteuid() != 0:
        return "not root, cannot start dockerd"
    try:
        proc = subprocess.run(["bash", str(script)], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return f"{script} timed out"
    return (proc.stdout + proc.stderr).strip()[-2000:] or f"exit {proc.returncode}"


@pytest.fixture(scope="session")
def docker_client():
    """A ``docker.DockerClient`` whose engine answers and has the sandbox image.

    If no engine answers and we are root, ``scripts/docker_engine.sh`` is run
    once to install/start one; skips only when none can be started."""
    docker = pytest.importorskip("docker", reason="docker SDK missing: pip install '.[docker]'")
    from tangram.executors.docker_image import engine_error, ensure_image

    reason = engine_error()
    if reason is not None:
        script_out = _start_docker_engine()
        if engine_error() is not None:
            from tests.helpers import missing

            missing("a Docker Engine", "run scripts/docker_engine.sh as root", detail=f"{reason}; {script_out}")
    client = docker.from_env(timeout=120)
    ensure_image(client)
    yield client
    client.close()


# The suite loads torch, Ray (grpc) and verl into one process; on rare runs one of their native
# finalizers crashed the interpreter's teardown (SIGSEGV) after every test had passed and the
# summary was printed. Once pytest has reported, the process ends with pytest's own exit status
# without that teardown. Failures still fail: the status is the session's.
_EXIT_STATUS: list[int] = []


def pytest_sessionfinish(session, exitstatus):
    _EXIT_STATUS.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _EXIT_STATUS and os.environ.get("TANGRAM_TESTS_SKIP_TEARDOWN", "1") == "1":
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_EXIT_STATUS[-1])
