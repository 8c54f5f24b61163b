"""A missing optional dependency: a skip naming what to install, or under CI=true a failure."""
from __future__ import annotations

import pytest

from tests.helpers import missing


def test_outside_ci_a_missing_dependency_skips_and_names_the_install(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"verl is missing \(pip install -r scripts/test-requirements.txt\)"):
        missing("verl", "pip install -r scripts/test-requirements.txt")


def test_under_ci_a_missing_dependency_fails(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true: torch is missing"):
        missing("torch", "pip install -r scripts/test-requirements-torch.txt")


def test_importorskip_goes_through_the_same_rule(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no_such_module_for_tangram_tests is missing"):
        pytest.importorskip("no_such_module_for_tangram_tests")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="pip install"):
        pytest.importorskip("no_such_module_for_tangram_tests")
    assert pytest.importorskip("json").dumps([]) == "[]"  # present: imported as before
