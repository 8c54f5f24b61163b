"""tangram.core.atomic_file: the one writer behind the profile store and the dataset patcher."""
from __future__ import annotations

import os
import stat

import pytest

from profiling.store import ProfileStore
from tangram.core.atomic_file import replace_atomically


def _leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_a_new_file_gets_the_mode_open_would_give_and_a_rewrite_keeps_its_own(tmp_path):
    old = os.umask(0o027)
    try:
        out = tmp_path / "f.json"
        replace_atomically(out, lambda fh: fh.write(b"one"))
        assert out.read_bytes() == b"one" and stat.S_IMODE(out.stat().st_mode) == 0o640
        out.chmod(0o604)
        replace_atomically(out, lambda fh: fh.write(b"two"))
        assert out.read_bytes() == b"two" and stat.S_IMODE(out.stat().st_mode) == 0o604
    finally:
        os.umask(old)
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_or_interrupted_write_leaves_the_file_as_it_was_and_no_temporary_file(tmp_path, error):
    out = tmp_path / "f.json"
    out.write_bytes(b"before")

    def write(fh):
        fh.write(b"half")
        raise error

    with pytest.raises(type(error)):
        replace_atomically(out, write)
    assert out.read_bytes() == b"before"
    assert _leftovers(tmp_path) == []


def test_a_symlink_keeps_its_link_and_its_target_is_replaced(tmp_path):
    real = tmp_path / "real.json"
    real.write_bytes(b"old")
    link = tmp_path / "link.json"
    link.symlink_to(real.name)
    replace_atomically(link, lambda fh: fh.write(b"new"))
    assert link.is_symlink() and real.read_bytes() == b"new"


def test_the_profile_store_saved_through_a_symlink_keeps_the_link(tmp_path):
    real = tmp_path / "profiles.json"
    ProfileStore().save(real)
    link = tmp_path / "current.json"
    link.symlink_to(real.name)
    ProfileStore().save(link)
    assert link.is_symlink() and ProfileStore.load(link).classes == {}
    assert _leftovers(tmp_path) == []
