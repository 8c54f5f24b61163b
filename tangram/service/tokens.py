"""Where tokens live: the service's bearer token file and the clients' view of it."""
from __future__ import annotations

import os
from pathlib import Path

from tangram.core.errors import ConfigError

DEFAULT_TOKEN_FILE = "~/.config/tangram/token"


def default_token_file() -> str:
    """Where ``tangram serve`` keeps its token when none is configured, and where clients look for it:
    ``$TANGRAM_TOKEN_FILE``, else ``~/.config/tangram/token``."""
    return token_path(os.environ.get("TANGRAM_TOKEN_FILE") or DEFAULT_TOKEN_FILE)


def client_token() -> str | None:
    """The token a client on this machine uses: ``$TANGRAM_TOKEN``, else the default token file if readable."""
    tok = os.environ.get("TANGRAM_TOKEN")
    if tok:
        return tok.strip()
    try:
        return Path(default_token_file()).read_text().strip() or None
    except OSError:
        return None


def token_path(path: str, base_dir: str | Path | None = None) -> str:
    """``~`` expanded; a relative path is relative to ``base_dir`` (the config file's folder)."""
    p = Path(path).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    return str(p.resolve())


def read_token_file(path: str, where: str = "token_file") -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(where, f"cannot read {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(where, f"{path} is not UTF-8 text") from None
    if not token:
        raise ConfigError(where, f"{path} is empty")
    return token
