"""``tangram profile`` on bad input: unreadable stores, awkward class names, bad configs, missing DoP 1.

Each case failed before with a traceback, a lost store, or a silently wrong profile.
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the profiling extra is missing: pip install '.[profiling]'")

from profiling.config import load_config, parse_config  # noqa: E402
from profiling.fit import FitResult, Sample, Unfit, fit_class  # noqa: E402
from profiling.store import ProfileStore, StoreError  # noqa: E402
from profiling.sweep import ClassSpec, environment_id  # noqa: E402
from tangram.cli import main  # noqa: E402
from tangram.executors.base import ExecResult  # noqa: E402

COUNTER_CMD = f"{sys.executable} -c \"open('runs.txt', 'a').write('${{parallel_num}}' + chr(10))\""
ANY_NOISE = ["--max-cv-error", "1e9"]  # these tests check bookkeeping, not the fit


def _work(tmp_path: Path) -> Path:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return work


def _profile(tmp_path: Path, out: Path, *extra: str, name: str = "c") -> int:
    return main(["profile", "--name", name, "--command", COUNTER_CMD, "--workdir", str(_work(tmp_path)),
                 "--dop", "1,2", "--repeats", "1", "--warmups", "0", "--out", str(out), "--no-progress",
                 *ANY_NOISE, *extra])


# --------------------------------------------------------------------------- #
# the store: never overwrite one it cannot read; keep its permissions

_GOOD_ENTRY = {"t1_s": 1.0, "efficiency": {"1": 1.0}, "samples": 6}


@pytest.mark.parametrize("content,reason", [
    (json.dumps({"version": 1, "classes": {"other": {**_GOOD_ENTRY, "samples": 6.0}}}).encode(), "samples"),
    (json.dumps({"version": 2, "classes": {"other": _GOOD_ENTRY}}).encode(), "unsupported version 2"),
    (json.dumps({"version": 1, "classes": {}, "unfit": {"x": 5}}).encode(), "unfit['x']: must be an object"),
    (b"\xff\xfe{}", "not UTF-8"),
])
def test_unreadable_store_is_refused_before_sweeping(tmp_path, capsys, content, reason):
    out = tmp_path / "p.json"
    out.write_bytes(content)
    assert _profile(tmp_path, out) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert str(out) in err and reason in err and "Traceback" not in err
    assert out.read_bytes() == content  # untouched: the other classes are still there
    assert not (tmp_path / "work" / "runs.txt").exists()  # refused before anything ran
    assert not (tmp_path / "p.json.samples.jsonl").exists()


@pytest.mark.parametrize("content", [b"\xff\xfe{}", json.dumps({"version": 1, "unfit": {"x": [1]}}).encode()])
def test_store_load_gives_store_errors_not_tracebacks(tmp_path, content):
    p = tmp_path / "p.json"
    p.write_bytes(content)
    with pytest.raises(StoreError, match=re.escape(str(p))):
        ProfileStore.load(p)


def test_save_keeps_the_mode_of_an_existing_store(tmp_path):
    out = tmp_path / "p.json"
    ProfileStore().save(out)
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o644 & ~umask  # a new store: not mkstemp's 0600
    out.chmod(0o640)
    assert _profile(tmp_path, out) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    assert "c" in json.loads(out.read_text())["classes"]


# --------------------------------------------------------------------------- #
# one class must not sink the sweep


def test_class_names_outside_the_safe_characters_are_profiled(tmp_path):
    out = tmp_path / "p.json"
    assert _profile(tmp_path, out, name="pytest:django/django") == 0
    assert "pytest:django/django" in json.loads(out.read_text())["classes"]


def test_environment_ids_are_safe_and_distinct():
    ids = {environment_id(ClassSpec(name=n, command="true")) for n in ("a:b", "a/b", "a_b", "ü b")}
    assert len(ids) == 4
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+", i) for i in ids)


class _FakeImageExecutor:
    """Stands in for the docker executor: accepts its own image only, like DockerExecutor."""

    name = "fake-docker"
    made: list[str] = []

    def __init__(self, image: str):
        self.image = image
        _FakeImageExecutor.made.append(image)

    async def create_environment(self, env_id, *, image=None, **_):
        if image != self.image:
            raise ValueError(f"image: {image!r} is not an allowed image (allowed: [{self.image!r}])")
        if image == "broken":
            raise RuntimeError("the engine said no")

    async def exec(self, env_id, command, placement, *, timeout_s=None, env=None):
        return ExecResult("succeeded", 0, isolation="fake")

    async def destroy_environment(self, env_id):
        pass

    async def close(self):
        pass


def _images_config(tmp_path: Path, images: dict[str, str]) -> Path:
    cfg = tmp_path / "sweep.yaml"
    classes = "".join(f"  {n}: {{command: 'true', image: {img}}}\n" for n, img in images.items())
    cfg.write_text(f"executor: docker\nmax_cv_error: 1.0e9\ndefaults: {{repeats: 2, warmups: 0, dops: [1, 2]}}\n"
                   f"classes:\n{classes}")
    return cfg


def test_each_image_gets_an_executor_that_accepts_it(tmp_path, monkeypatch):
    monkeypatch.setattr("profiling.pipeline.make_executor", lambda kind, spec: _FakeImageExecutor(spec.image))
    _FakeImageExecutor.made = []
    out = tmp_path / "p.json"
    assert main(["profile", "--config", str(_images_config(tmp_path, {"a": "img-a", "b": "img-b"})),
                 "--out", str(out), "--no-progress"]) == 0
    assert set(json.loads(out.read_text())["classes"]) == {"a", "b"}
    assert sorted(_FakeImageExecutor.made) == ["img-a", "img-b"]


def test_a_class_that_raises_keeps_the_others(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("profiling.pipeline.make_executor", lambda kind, spec: _FakeImageExecutor(spec.image))
    out = tmp_path / "p.json"
    cfg = _images_config(tmp_path, {"first": "img-a", "bad": "broken", "last": "img-b"})
    assert main(["profile", "--config", str(cfg), "--out", str(out), "--no-progress"]) == 1
    assert set(json.loads(out.read_text())["classes"]) == {"first", "last"}
    err = " ".join(capsys.readouterr().err.split())
    assert "class 'bad'" in err and "the engine said no" in err


@pytest.mark.parametrize("executor", ["subprocess", "local"])
def test_an_image_on_a_host_executor_is_refused_up_front(tmp_path, capsys, executor):
    work = _work(tmp_path)
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(f"executor: {executor}\nclasses:\n  first: {{command: {json.dumps(COUNTER_CMD)}, workdir: {work}}}\n"
                   "  boxed: {command: 'true', image: 'some-image:1'}\n")
    assert main(["profile", "--config", str(cfg), "--out", str(tmp_path / "p.json"), "--no-progress"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "classes.boxed.image" in err and executor in err
    assert not (work / "runs.txt").exists() and not (tmp_path / "p.json").exists()


# --------------------------------------------------------------------------- #
# fit: without a DoP-1 sample, T1 must come from a model that reaches m = 1


def test_no_dop1_sample_only_amdahl_may_be_chosen():
    samples = [Sample(d, t, r) for r in range(3) for d, t in {2: 20.0, 4: 10.0, 8: 10.0}.items()]
    res = fit_class(samples)
    assert isinstance(res, FitResult) and res.model == "amdahl"
    assert res.t1_s > 20.0 + 1e-6 and res.efficiency[2] > 0.5  # not T(2) repeated at m = 1
    res = fit_class(samples, max_cv_error=0.05)
    assert isinstance(res, Unfit) and "DoP-1" in res.reason and "amdahl" in res.reason


# --------------------------------------------------------------------------- #
# the YAML config: every mistake named before anything runs

_BASE = {"classes": {"a": {"command": "true"}}}


@pytest.mark.parametrize("doc,needle", [
    ({"classes": {"a": {"command": "true", "env": [1, 2]}}}, "classes.a: env: must be a mapping"),
    ({**_BASE, "defaults": [1, 2]}, "defaults: must be a mapping"),
    ({"classes": {"a": {"command": 123}}}, "classes.a: command: must be a non-empty string"),
    ({"classes": {"a": {"command": None}}}, "classes.a: command: must be a non-empty string"),
    ({**_BASE, "executor": "foo"}, "executor: must be one of"),
    ({"classes": {"a": {"command": "true", "timeout_s": "abc"}}}, "classes.a: timeout_s: must be a positive"),
    ({"classes": {"a": {"command": "true", "timeout_s": -1}}}, "classes.a: timeout_s: must be a positive"),
    ({**_BASE, "max_cv_error": "abc"}, "max_cv_error: must be a positive number"),
    ({"classes": {"a": {"command": "true", "repeats": 2.5}}}, "classes.a: repeats: must be an integer >= 1"),
    ({"classes": {"a": {"command": "true", "warmups": 1.5}}}, "classes.a: warmups: must be an integer >= 0"),
    ({**_BASE, "defaults": {"repeats": True}}, "defaults: repeats: must be an integer"),
    ({"classes": {"a": {"command": "true", "dops": 4}}}, "classes.a: dops: must be a non-empty list"),
    ({**_BASE, "defualts": {}}, "unknown keys ['defualts']"),
    ({**_BASE, "max_cv_eror": 1}, "unknown keys ['max_cv_eror']"),
    ({"classes": {"a": {"comand": "true"}}}, "classes.a: unknown keys ['comand']"),
    ({"classes": [{"name": "x", "command": "true"}, {"name": "x", "command": "false"}]},
     "classes[1]: duplicate class name 'x' (also "),
    ({"classes": {"a": 5}}, "classes.a: must be a mapping"),
    ({"classes": 5}, "classes: must be a mapping or a list"),
])
def test_config_mistakes_are_named(doc, needle):
    with pytest.raises(ValueError) as info:
        parse_config(doc, source="sweep.yaml")
    assert needle in str(info.value)
    assert str(info.value).startswith("sweep.yaml: ")


def test_config_accepts_the_documented_forms(tmp_path):
    cfg = parse_config({"max_cv_error": "1e9", "defaults": {"repeats": 2, "env": {"A": 1}},
                        "classes": {"a": "true", "b": {"command": "true", "timeout_s": 5}}})
    assert cfg.max_cv_error == 1e9
    assert [(s.name, s.repeats, s.env, s.timeout_s) for s in cfg.classes] == [
        ("a", 2, {"A": "1"}, None), ("b", 2, {"A": "1"}, 5.0)]


@pytest.mark.parametrize("text,needle", [
    ("classes: [\n", "not valid YAML"),
    ("classes:\n  a: true\n  a: false\n", "duplicate key 'a'"),
    ("classes:\n  a: {command: true}\nclasses: {}\n", "duplicate key 'classes'"),
])
def test_bad_yaml_is_a_clear_usage_error(tmp_path, capsys, text, needle):
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text(text)
    with pytest.raises(ValueError, match=needle):
        load_config(str(cfg))
    assert main(["profile", "--config", str(cfg), "--out", str(tmp_path / "p.json"), "--no-progress"]) == 2
    assert needle in " ".join(capsys.readouterr().err.split())  # rich wraps long lines


def test_dops_above_the_cores_available_are_warned_of(tmp_path, capsys):
    from profiling.sweep import available_cores
    from tangram.cli import main

    over = len(available_cores()) + 1
    out = tmp_path / "p.json"
    rc = main(["profile", "--name", "over", "--command", "true", "--workdir", str(tmp_path), "--dop", f"1,{over}",
               "--repeats", "1", "--warmups", "0", "--out", str(out), "--no-progress", "--max-cv-error", "1e9"])
    err = capsys.readouterr().err
    assert rc in (0, 1) and f"DoP {over} run on the {over - 1} cores available" in " ".join(err.split())
