"""``tangram serve``: run the scheduler service."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "serve", help="run the scheduler service (HTTP API)",
        description="Run the scheduler service: an HTTP API (aiohttp) that takes actions (shell commands, "
                    "test-suite rewards, API calls, GPU model calls), schedules each on the cluster's pools "
                    "and returns its result. Without --config the service manages this machine as one local "
                    "CPU node.")
    p.add_argument("--config", action="append",
                   help="cluster YAML (default: this machine as one local CPU node); repeat it to merge files in "
                        "order, e.g. a cluster file and the scheduler fragment of `tangram tune --config-out`")
    p.add_argument("--host", help="address to bind (default 127.0.0.1, or the config's service.host)")
    p.add_argument("--port", type=int, help="port (default 8471, or the config's; 0 picks a free one)")
    p.add_argument("--token-file", help="file holding the bearer token every route but /healthz requires "
                                        "(created with a fresh token, mode 0600, if it does not exist)")
    p.add_argument("--no-auth", action="store_true",
                   help="serve without a bearer token (anyone who can reach the port runs commands); by default a "
                        "token is read from, or created in, $TANGRAM_TOKEN_FILE or ~/.config/tangram/token")
    p.add_argument("--state-dir",
                   help="where environments and actions are recorded (SQLite) so a restart reattaches them "
                        "(default: service.state_dir, else $TANGRAM_STATE_DIR, else "
                        "${XDG_STATE_HOME:-~/.local/state}/tangram/<key>, <key> a hash of the CPU nodes served: "
                        "the same whatever the port)")
    p.add_argument("--check", action="store_true",
                   help="validate the config (fields, cores and memory of this machine, profile stores) and exit "
                        "without starting or reaching any node")
    p.add_argument("--sandbox-key-file", help="file holding the key of the SandboxFusion-compatible endpoint "
                   "POST /sandbox/<key>/run_code (a secret: it is part of the URL; opens that route only)")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import asyncio
    import dataclasses
    import logging
    import os
    import signal
    import sys

    from tangram.core.errors import FieldError
    from tangram.service.config import ConfigError, default_token_file, load_config, read_token_file, token_path
    from tangram.service.sandbox_protocol import read_key_file

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config)
        svc = cfg.service
        if args.host:
            svc = dataclasses.replace(svc, host=args.host)
        if args.port is not None:
            svc = dataclasses.replace(svc, port=args.port)
        if args.token_file:
            path = token_path(args.token_file)
            token = read_token_file(path, "--token-file") if os.path.exists(path) else None
            svc = dataclasses.replace(svc, token=token, token_file=path)
        if args.state_dir:
            svc = dataclasses.replace(svc, state_dir=token_path(args.state_dir))
        elif svc.state_dir is None:
            from tangram.service.recover import default_state_dir

            svc = dataclasses.replace(svc, state_dir=token_path(os.environ.get("TANGRAM_STATE_DIR")
                                                                or default_state_dir(cfg)))
        if args.no_auth:
            if svc.token or svc.token_file:
                raise ConfigError("--no-auth", "a token is configured (service.token / token_file / --token-file)")
        elif svc.token is None and svc.token_file is None:  # a token by default: the default file, made if new
            path = default_token_file()
            token = read_token_file(path, "token file") if os.path.exists(path) else None
            svc = dataclasses.replace(svc, token=token, token_file=path)
        sandbox = cfg.sandbox_fusion
        if args.sandbox_key_file:
            try:
                sandbox = dataclasses.replace(sandbox, key=read_key_file(token_path(args.sandbox_key_file),
                                                                         "--sandbox-key-file"))
            except FieldError as exc:
                raise ConfigError(exc.field, exc.reason) from None
        if sandbox.key is not None and sandbox.key == svc.token:
            raise ConfigError("--sandbox-key-file", "the sandbox key must differ from the service token")
        cfg = dataclasses.replace(cfg, service=svc, sandbox_fusion=sandbox)
        if args.check:
            print(check_summary(cfg))
            return 0
        if svc.token is None and svc.token_file:
            svc = dataclasses.replace(svc, token=create_token_file(svc.token_file))
            cfg = dataclasses.replace(cfg, service=svc)
    except ConfigError as exc:
        print(f"tangram serve: config error: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        from tangram.service.app import create_app, start_site

        app = create_app(cfg)
        from tangram.service.gc_pauses import freeze_startup_objects

        async def freeze(_app) -> None:  # built, not yet listening: no request's objects are frozen
            logging.getLogger("tangram.service").info(
                "froze %d startup objects: garbage collections skip them (docs/service.md)", freeze_startup_objects())

        app.on_startup.append(freeze)  # after the runtime's start (the cleanup context's, added first)
        runner, port = await start_site(app, svc.host, svc.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # one parseable line: tests and scripts started with --port 0 read the port from it
        print(f"tangram serve: listening on {'https' if svc.tls_cert else 'http'}://{svc.host}:{port}", flush=True)
        if svc.token_file:
            print(f"tangram serve: bearer token in {svc.token_file}", flush=True)
        print(f"tangram serve: state in {svc.state_dir or 'memory only (nothing survives a restart)'}", flush=True)
        log = logging.getLogger("tangram.service")
        if not svc.token:
            log.warning("--no-auth: no bearer token - anyone who can reach %s:%d can run commands here",
                        svc.host, port)
        if svc.host not in ("127.0.0.1", "localhost", "::1") and not svc.tls_cert:
            log.warning("listening on %s without TLS: the token crosses the network in clear "
                        "(set service.tls_cert and service.tls_key)", svc.host)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()  # cancels running actions, removes environments

    _use_pidfd_child_watcher()
    raised = raise_open_files_limit()
    if raised is not None:
        logging.getLogger("tangram.service").info("open files limit raised from %d to %d (every waiting "
                                                  "request holds a socket, every running action pipes)", *raised)
    try:
        asyncio.run(serve())
    except ConfigError as exc:
        print(f"tangram serve: config error: {exc}", file=sys.stderr)
        return 2
    return 0


def create_token_file(path: str) -> str:
    """A fresh random token written to ``path``, readable by its owner only (never overwrites)."""
    import os
    import secrets

    from tangram.service.config import ConfigError

    token = secrets.token_urlsafe(32)
    try:
        os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise ConfigError("service.token_file", f"cannot create {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def check_summary(cfg) -> str:
    """What ``serve --check`` found: the config parsed and its profile stores load; nothing reached."""
    from tangram.profiles import load_profiles
    from tangram.service.config import ConfigError

    classes = 0
    for i, path in enumerate(cfg.profiles):
        try:
            classes += len(load_profiles(path))
        except ValueError as exc:
            raise ConfigError(f"profiles[{i}]", str(exc)) from None
    if cfg.scaleout is not None:
        from tangram.scaleout.config import parse_scaleout

        parse_scaleout(cfg.scaleout)
    cpu = ", ".join(f"{n.name} ({n.executor}, {len(n.cores) or 'discovered'} cores)" for n in cfg.cpu_nodes) or "none"
    gpu = ", ".join(f"{n.name} ({len(n.gpus)} GPUs, {len(n.services)} services)" for n in cfg.gpu_nodes) or "none"
    api = ", ".join(p.name for p in cfg.api_pools) or "none"
    token = (f"from {cfg.service.token_file}" + ("" if cfg.service.token else " (created at start)")
             if cfg.service.token_file else "set" if cfg.service.token else "none")
    sf = cfg.sandbox_fusion
    if sf.key is None and (cfg.service.token or cfg.service.token_file):
        sandbox = "off (no sandbox key)"
    else:
        sandbox = f"POST /sandbox/{'<key>/' if sf.key else ''}run_code ({', '.join(sorted(sf.languages)) or 'no languages'})"
    return (f"config OK: cpu nodes: {cpu}; gpu nodes: {gpu}; api pools: {api}; "
            f"profile classes: {classes}; token: {token}; sandbox_fusion: {sandbox}")


def _use_pidfd_child_watcher() -> None:
    """Python < 3.12 reaps each subprocess with a thread of its own (ThreadedChildWatcher);
    a pidfd in the event loop is much cheaper for hundreds of short actions per second.
    Python 3.12+ does this by itself."""
    import asyncio
    import os
    import sys
    import warnings

    if sys.version_info >= (3, 12) or not hasattr(os, "pidfd_open"):
        return
    try:
        os.close(os.pidfd_open(os.getpid()))  # the kernel may lack pidfd (Linux < 5.3)
    except OSError:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.get_event_loop_policy().set_child_watcher(asyncio.PidfdChildWatcher())


def raise_open_files_limit(cap: int = 1 << 20) -> tuple[int, int] | None:
    """Raise this process's soft limit on open files to its hard limit (at most ``cap``); returns
    ``(old, new)`` when it did. Each request waiting for its action holds a socket and each running
    action three pipes, and a login shell's usual soft limit, 1,024, is a rollout's worth: past it
    ``accept`` and the spawns fail (400 waiting actions under a limit of 256 failed 265 of them
    with "Too many open files"). The commands inherit it, as a container's do."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return None
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return None
    return soft, target
