"""``tangram serve`` authenticates by default: with no token configured it makes one (a 0600 file whose
path it prints) and refuses callers without it; serving without auth takes an explicit flag. TLS serves
the same API over HTTPS."""
from __future__ import annotations

import os
import ssl
import stat
from pathlib import Path

import aiohttp
import pytest

from tangram.service.launch import ServeProcess, start_serve

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(180)


def _start(args: list[str], env: dict) -> ServeProcess:
    # the whole output kept: the tests read the token file's path and the warnings from it
    return start_serve(["--port", "0", *args], env=env, cwd=REPO, tail_lines=None)


def _stop(srv: ServeProcess) -> str:
    srv.stop(grace_s=30)
    return srv.output()


async def test_serve_makes_a_token_by_default_and_requires_it(tmp_path):
    tok_file = tmp_path / "conf" / "token"
    env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tok_file)}
    env.pop("TANGRAM_TOKEN", None)
    srv = _start([], env)
    try:
        url = srv.url
        assert srv.wait_for_output(str(tok_file)), srv.output()  # the path is printed
        assert stat.S_IMODE(tok_file.stat().st_mode) == 0o600
        token = tok_file.read_text().strip()
        assert len(token) >= 32
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/stats") as r:
                assert r.status == 401
            async with s.get(f"{url}/v1/stats", headers={"Authorization": f"Bearer {token}"}) as r:
                assert r.status == 200
            async with s.get(f"{url}/healthz") as r:
                assert r.status == 200
    finally:
        _stop(srv)
    # a second start reuses the same token
    srv = _start([], env)
    try:
        assert tok_file.read_text().strip() == token
    finally:
        _stop(srv)


async def test_no_auth_is_explicit_and_warned(tmp_path):
    env = {**os.environ, "TANGRAM_TOKEN_FILE": str(tmp_path / "unused")}
    srv = _start(["--no-auth"], env)
    try:
        async with aiohttp.ClientSession() as s, s.get(f"{srv.url}/v1/stats") as r:
            assert r.status == 200
    finally:
        err = _stop(srv)
    assert "no bearer token" in err
    assert not (tmp_path / "unused").exists()


async def test_tls_serves_https(tmp_path):
    import trustme
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"service:\n  tls_cert: {tmp_path / 'cert.pem'}\n  tls_key: {tmp_path / 'key.pem'}\n"
                   f"  token: t0ken-over-tls\ngpu_nodes: []\n")
    srv = _start(["--config", str(cfg)], dict(os.environ))
    try:
        url = srv.url
        assert url.startswith("https://")
        ctx = ssl.create_default_context()
        ca.configure_trust(ctx)
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{url}/v1/stats", ssl=ctx, headers={"Authorization": "Bearer t0ken-over-tls"}) as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientError):  # plain HTTP to the TLS port is no request
                async with s.get(url.replace("https://", "http://") + "/healthz") as r:
                    await r.read()
    finally:
        _stop(srv)
