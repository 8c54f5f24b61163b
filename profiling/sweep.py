"""Offline profiling sweeps: run each action class at each DoP, a few times.

A sweep runs through the service's own executors (``EnvironmentExecutor``):
every point gets a :class:`~tangram.executors.base.Placement` with an
exclusive core set of ``dop`` cores, so the local executor pins the process
with cgroups (cpuset + CFS quota) or ``sched_setaffinity``, not just ``-n``.
``${parallel_num}`` in the command is replaced by the DoP.

Resume: each measured sample is appended (and flushed) to a JSONL file next to
the output (``OUT.samples.jsonl``), keyed by class / DoP / repeat together with
a fingerprint of the command, working directory and image; a rerun skips
every key already there, so an interrupted sweep continues where it stopped.
Samples of a changed command are ignored, not reused.

Order: repeat-major (``r0: dop 1, 2, 4; r1: dop 1, 2, 4; ...``) so slow drift
of a shared machine spreads over all DoPs instead of biasing one.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shlex
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from tangram.core.model import render_command

from profiling.fit import Sample


class SweepError(RuntimeError):
    """A class could not be measured: its command failed (non-zero exit, not found, timeout), or
    its environment could not be made (``dop`` None)."""

    def __init__(self, cls: str, dop: int | None, message: str, stderr: str = ""):
        self.cls, self.dop, self.stderr = cls, dop, stderr
        super().__init__(f"class {cls!r}{'' if dop is None else f' at DoP {dop}'}: {message}")


def available_cores() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(os.cpu_count() or 1))


def default_dops(ncores: int | None = None) -> list[int]:
    """1, 2, 4, ... up to the cores available (and the core count itself)."""
    n = ncores if ncores is not None else len(available_cores())
    out, m = [], 1
    while m <= n:
        out.append(m)
        m *= 2
    if out[-1] != n:
        out.append(n)
    return out


@dataclass(slots=True)
class ClassSpec:
    name: str
    command: str
    workdir: str | None = None
    image: str | None = None
    dops: list[int] | None = None
    repeats: int = 3
    warmups: int = 1
    timeout_s: float | None = None
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("class name must be non-empty")
        if not self.command or not self.command.strip():
            raise ValueError(f"class {self.name!r}: command must be non-empty")
        if self.repeats < 1:
            raise ValueError(f"class {self.name!r}: repeats must be >= 1, got {self.repeats}")
        if self.warmups < 0:
            raise ValueError(f"class {self.name!r}: warmups must be >= 0, got {self.warmups}")
        if self.dops is not None:
            if not self.dops or any((not isinstance(d, int)) or isinstance(d, bool) or d < 1 for d in self.dops):
                raise ValueError(f"class {self.name!r}: dops must be positive integers, got {self.dops!r}")
            self.dops = sorted(set(self.dops))
        if self.workdir is not None:
            self.workdir = os.path.abspath(os.path.expanduser(self.workdir))
            if not os.path.isdir(self.workdir):
                raise ValueError(f"class {self.name!r}: workdir {self.workdir!r} is not a directory")

    def fingerprint(self) -> str:
        raw = json.dumps([self.command, self.workdir, self.image, sorted(self.env.items())])
        return hashlib.sha256(raw.encode()).hexdigest()[:16]

    def dop_list(self) -> list[int]:
        return list(self.dops) if self.dops else default_dops()


_UNSAFE_IN_ID = re.compile(r"[^A-Za-z0-9_.-]")


def environment_id(spec: ClassSpec) -> str:
    """An environment id executors accept ([A-Za-z0-9_.-]) for any class name.

    Names like ``pytest:django/django`` are sanitised; the hash of the real
    name keeps two names that sanitise alike apart.
    """
    digest = hashlib.sha256(spec.name.encode()).hexdigest()[:8]
    return f"profile-{_UNSAFE_IN_ID.sub('_', spec.name)[:40]}-{digest}-{os.getpid()}"


def samples_path(out: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(out)}.samples.jsonl")


class SampleLog:
    """The append-only JSONL of measured samples (the resume state)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []
        self._torn = False  # the last line was cut short (no newline): start the next write on a fresh line
        if self.path.exists():
            with open(self.path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell() > 0:
                    f.seek(-1, os.SEEK_END)
                    self._torn = f.read(1) != b"\n"
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by an interruption
                    if isinstance(rec, dict) and {"class", "dop", "repeat", "seconds"} <= rec.keys():
                        self.records.append(rec)

    def done(self, spec: ClassSpec) -> dict[tuple[int, int], float]:
        fp = spec.fingerprint()
        return {(int(r["dop"]), int(r["repeat"])): float(r["seconds"])
                for r in self.records if r["class"] == spec.name and r.get("fingerprint") == fp}

    def samples(self, spec: ClassSpec) -> list[Sample]:
        """This sweep's samples: its DoPs and repeats only (an earlier, wider sweep's extras are left out)."""
        dops = set(spec.dop_list())
        return [Sample(d, s, r) for (d, r), s in sorted(self.done(spec).items()) if d in dops and r < spec.repeats]

    def append(self, rec: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(("\n" if self._torn else "") + json.dumps(rec) + "\n")
            self._torn = False
            f.flush()
            os.fsync(f.fileno())
        self.records.append(rec)


def plan_points(spec: ClassSpec, done: Mapping[tuple[int, int], float]) -> list[tuple[int, int]]:
    """(dop, repeat) points still to measure, repeat-major."""
    return [(d, r) for r in range(spec.repeats) for d in spec.dop_list() if (d, r) not in done]


def placement_for(action_id: str, dop: int, cores: Sequence[int]):
    from tangram.executors.base import Placement

    if dop <= len(cores):
        chosen = tuple(cores[:dop])
    else:  # oversubscribed: every core we have, a quota of all of them
        chosen = tuple(cores)
    return Placement(action_id=action_id, node=None, dop=dop, cores=chosen, cpu_quota=float(len(chosen)))


async def copy_workdir(executor, env_id: str, workdir: str) -> None:
    """Copy ``workdir``'s contents into a container environment's working directory (/work)."""
    container_id = getattr(executor, "container_id", None)
    if container_id is None:
        raise SweepError(env_id, 0, f"executor {executor.name!r} cannot receive a working directory")
    import io
    import tarfile

    def put() -> None:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for entry in sorted(os.listdir(workdir)):
                tar.add(os.path.join(workdir, entry), arcname=entry)
        if not executor.client.api.put_archive(container_id(env_id), "/work", buf.getvalue()):
            raise OSError(f"could not copy {workdir} into the container")

    await asyncio.to_thread(put)


def shell_in(workdir: str | None, command: str) -> str:
    return command if workdir is None else f"cd {shlex.quote(workdir)} && {command}"


async def run_point(executor, env_id: str, spec: ClassSpec, dop: int, cores: Sequence[int], tag: str) -> tuple[float, Any]:
    cmd = shell_in(spec.workdir if spec.image is None else None, render_command(spec.command, dop))
    placement = placement_for(f"profile-{spec.name}-{tag}", dop, cores)
    env = {"TANGRAM_DOP": str(dop), **spec.env}
    t0 = time.perf_counter()
    result = await executor.exec(env_id, cmd, placement, timeout_s=spec.timeout_s, env=env)
    elapsed = time.perf_counter() - t0
    if result.status != "succeeded":
        why = result.error or f"exit code {result.exit_code}"
        stderr = (result.stderr or "").strip()
        if result.stdout and result.stdout.strip():  # pytest reports its failures on stdout
            tail = "\n".join(result.stdout.strip().splitlines()[-30:])
            stderr = f"{stderr}\n--- stdout (last lines) ---\n{tail}" if stderr else tail
        raise SweepError(spec.name, dop, f"{why}: {render_command(spec.command, dop)}", stderr)
    return elapsed, result


@dataclass(slots=True)
class ClassOutcome:
    spec: ClassSpec
    samples: list[Sample] = field(default_factory=list)
    measured_now: int = 0
    reused: int = 0
    error: SweepError | None = None


async def sweep(
    specs: Iterable[ClassSpec],
    executor_for: Callable[[ClassSpec], Any],
    log: SampleLog,
    *,
    cores: Sequence[int] | None = None,
    progress=None,
    on_point: Callable[[ClassSpec, int, int, float], None] | None = None,
) -> list[ClassOutcome]:
    """Measure every pending point of every class; one failing class does not stop the rest."""
    cores = list(cores if cores is not None else available_cores())
    specs = list(specs)
    pending = {s.name: plan_points(s, log.done(s)) for s in specs}
    task = None
    if progress is not None:
        total = sum(len(p) + (s.warmups if p else 0) for s, p in zip(specs, pending.values()))
        task = progress.add_task("profiling", total=total)
    outcomes = []
    for spec in specs:
        out = ClassOutcome(spec, reused=len(log.samples(spec)))
        outcomes.append(out)
        points = pending[spec.name]
        if points:
            try:
                await _measure(spec, points, executor_for, log, cores, out, progress, task, on_point)
            except SweepError as exc:
                out.error = exc
            except Exception as exc:  # noqa: BLE001 - e.g. an executor that refuses the class: this class only
                out.error = SweepError(spec.name, None, _describe_exception(exc))
            if out.error is not None and progress is not None and task is not None:
                # the failed class's points will not come
                later = specs[specs.index(spec) + 1:]
                progress.update(task, total=next(t.completed for t in progress.tasks if t.id == task) + sum(
                    len(pending[s.name]) + (s.warmups if pending[s.name] else 0) for s in later))
        out.samples = log.samples(spec)
    return outcomes


async def _measure(spec: ClassSpec, points: list[tuple[int, int]], executor_for, log: SampleLog,
                   cores: Sequence[int], out: ClassOutcome, progress, task, on_point) -> None:
    """One class's warm-ups and pending points, in an environment of its own; each sample logged at once."""
    executor = executor_for(spec)
    env_id = environment_id(spec)
    await executor.create_environment(env_id, image=spec.image, labels={"profile": spec.name})
    try:
        if spec.image is not None and spec.workdir is not None:
            await copy_workdir(executor, env_id, spec.workdir)
        warm_dop = max(spec.dop_list())  # the fastest run warms caches as well as any
        for w in range(spec.warmups):
            _describe(progress, task, f"{spec.name}: warm-up {w + 1}/{spec.warmups} (dop {warm_dop})")
            await run_point(executor, env_id, spec, warm_dop, cores, f"warmup{w}")
            _advance(progress, task)
        for dop, rep in points:
            _describe(progress, task, f"{spec.name}: dop {dop}, repeat {rep + 1}/{spec.repeats}")
            secs, res = await run_point(executor, env_id, spec, dop, cores, f"d{dop}r{rep}")
            log.append({"class": spec.name, "dop": dop, "repeat": rep, "seconds": secs,
                        "fingerprint": spec.fingerprint(), "command": spec.command,
                        "workdir": spec.workdir, "image": spec.image, "cores": len(cores),
                        "isolation": res.isolation,
                        "load1": _load1(),
                        "at": time.time()})
            out.measured_now += 1
            if on_point is not None:
                on_point(spec, dop, rep, secs)
            _advance(progress, task)
    finally:
        try:
            await executor.destroy_environment(env_id)
        except Exception as exc:  # noqa: BLE001 - the class's own error (or its samples) is what counts
            warnings.warn(f"{spec.name}: removing its environment {env_id} failed: {exc}", stacklevel=1)


def _describe_exception(exc: Exception) -> str:
    # ValueError / OSError messages name their field or file; others need their type to make sense
    text = str(exc)
    return text if isinstance(exc, (ValueError, OSError)) and text else f"{type(exc).__name__}: {text}"


def _load1() -> float | None:
    """The 1-minute load average after the run (how shared the machine was)."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover
        return None


def _describe(progress, task, text: str) -> None:
    if progress is not None and task is not None:
        progress.update(task, description=text)


def _advance(progress, task) -> None:
    if progress is not None and task is not None:
        progress.advance(task)


# --------------------------------------------------------------------------- #
# executors


def make_executor(kind: str, spec: ClassSpec | None = None):
    """The service's executor of that kind (``local`` | ``docker``), or the fallback."""
    if kind == "auto":
        kind = "docker" if spec is not None and spec.image else "local"
    if kind == "local":
        try:
            from tangram.executors.local import LocalExecutor
        except ImportError:  # an older tree without the local executor
            from profiling.executor import PinnedSubprocessExecutor

            return PinnedSubprocessExecutor()
        # the user's own command in the user's own directory, run from their shell: no sandbox to cross
        return LocalExecutor(sandbox="none")
    if kind == "docker":
        from tangram.executors.docker import DockerExecutor  # type: ignore[import-not-found]
        from tangram.executors.docker_image import SANDBOX_IMAGE

        # the user's own image, named on their command line: allowed beside the default one
        images = {SANDBOX_IMAGE, spec.image} if spec is not None and spec.image else {SANDBOX_IMAGE}
        return DockerExecutor(allowed_images=tuple(images))
    if kind == "subprocess":
        from profiling.executor import PinnedSubprocessExecutor

        return PinnedSubprocessExecutor()
    raise ValueError(f"unknown executor kind {kind!r} (expected auto, local, docker or subprocess)")

