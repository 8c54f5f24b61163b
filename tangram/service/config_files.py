"""Reading config files (``load_config`` in :mod:`tangram.service.config`): YAML, merged in order, each
file's paths relative to that file."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from tangram.core.errors import ConfigError

# the file paths a config names, each relative to the file that names it (not to the first of several)
_FILE_KEYS = {"service": ("token_file", "state_dir", "tls_cert", "tls_key"), "sandbox_fusion": ("key_file",)}


def anchored(part: dict, folder: Path) -> dict:
    def anchor(f: Any) -> Any:
        return str((folder / os.path.expanduser(f)).resolve()) if isinstance(f, str) and f and not os.path.isabs(
            os.path.expanduser(f)) else f

    out = dict(part)
    if isinstance(out.get("profiles"), list):
        out["profiles"] = [anchor(f) for f in out["profiles"]]
    for section, keys in _FILE_KEYS.items():
        if isinstance(out.get(section), Mapping):
            out[section] = {k: anchor(v) if k in keys else v for k, v in out[section].items()}
    docker = out.get("scaleout", {}).get("docker_nodes") if isinstance(out.get("scaleout"), Mapping) else None
    if isinstance(docker, Mapping):  # a Docker node's TLS files
        tls_keys = ("ca_cert", "client_cert", "client_key")
        docker = {name: {**n, "tls": {k: anchor(v) if k in tls_keys else v for k, v in n["tls"].items()}}
                  if isinstance(n, Mapping) and isinstance(n.get("tls"), Mapping) else n for name, n in docker.items()}
        out["scaleout"] = {**out["scaleout"], "docker_nodes": docker}
    if isinstance(out.get("cpu_nodes"), list):  # a node's workdir too
        out["cpu_nodes"] = [{**n, "workdir": anchor(n["workdir"])} if isinstance(n, Mapping) and "workdir" in n
                            else n for n in out["cpu_nodes"]]
    return out


def read_yaml(p: Path) -> Any:
    import yaml

    try:
        doc = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise ConfigError(str(p), f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(str(p), f"not UTF-8 text: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(p), f"not valid YAML: {exc}") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, Mapping):
        raise ConfigError(str(p), f"must be a mapping of sections, got {type(doc).__name__}")
    return doc


def merged(base: Mapping[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = merged(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out
