"""Config files: each file's relative paths are relative to that file, several files merged in order,
and an unreadable file is a clear error naming it (tangram/service/config_files.py)."""
from __future__ import annotations

import pytest

from tangram.service.config import ConfigError, load_config


def test_each_files_paths_are_relative_to_that_file(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (b / "token").write_text("s3cret-token-of-b\n")
    (b / "sf.key").write_text("k" * 32 + "\n")
    for name in ("cert.pem", "key.pem"):
        (b / name).write_text("-")
    (a / "cluster.yaml").write_text("cpu_nodes:\n  - {name: n, executor: local, cores: 1, memory_mb: 512, "
                                    "workdir: envs}\n")
    (b / "service.yaml").write_text("service:\n  token_file: token\n  state_dir: state\n"
                                    "  tls_cert: cert.pem\n  tls_key: key.pem\n"
                                    "sandbox_fusion:\n  key_file: sf.key\n")
    cfg = load_config([a / "cluster.yaml", b / "service.yaml"])
    assert cfg.service.token == "s3cret-token-of-b"
    assert cfg.service.state_dir == str((b / "state").resolve())
    assert (cfg.service.tls_cert, cfg.service.tls_key) == (str(b / "cert.pem"), str(b / "key.pem"))
    assert (cfg.cpu_nodes[0].name, cfg.cpu_nodes[0].workdir) == ("n", str((a / "envs").resolve()))


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_bytes(b"cpu_nodes: \xff\xfe\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)
    (tmp_path / "token").write_bytes(b"\xff\xfe\xfd")
    ok = tmp_path / "s.yaml"
    ok.write_text("service:\n  token_file: token\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(ok)


def test_a_docker_nodes_tls_files_are_relative_to_the_file_that_names_them(tmp_path):
    from tangram.service.config_files import anchored

    part = {"scaleout": {"docker_nodes": {"n1": {"tls": {"ca_cert": "ca.pem", "client_cert": "/abs/c.pem",
                                                          "verify": True}, "probe": False}}}}
    got = anchored(part, tmp_path)["scaleout"]["docker_nodes"]["n1"]
    assert got["tls"] == {"ca_cert": str(tmp_path / "ca.pem"), "client_cert": "/abs/c.pem", "verify": True}
    assert got["probe"] is False and part["scaleout"]["docker_nodes"]["n1"]["tls"]["ca_cert"] == "ca.pem"
