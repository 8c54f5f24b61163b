"""The local Docker sandbox image and how to run containers from it.

No Docker registry is reachable from our machines, so the sandbox image
``tangram-sandbox:latest`` is built locally as a ``docker import`` of a tiny
rootfs that holds *no programs*: only empty mount points, a minimal
``/etc/passwd``/``/etc/group`` and ``/bin``, ``/lib``, ``/lib64``, ``/sbin``
laid out like the host's (symlinks into ``/usr`` on merged-/usr Debian).
Containers bind-mount the host's userland read-only (:data:`SANDBOX_BINDS`) so
the host's ``python3``/``bash``/``pytest``/``ps``/``pkill`` work inside, and put
the host interpreter's ``bin`` first on ``PATH`` (:data:`SANDBOX_ENV`).

``scripts/build_sandbox_image.sh`` builds the same image from the shell; this
module does it in Python (:func:`ensure_image`) so tests and executors need
no shell script.  ``docker`` is imported lazily: importing this module never
requires the ``docker`` extra.
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
import time
from typing import Any

SANDBOX_IMAGE = "tangram-sandbox:latest"
SANDBOX_LABEL = "org.arl-tangram.sandbox"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Dockerfile-style instructions applied by the import (same as the shell script).
IMAGE_CHANGES = [
    "WORKDIR /work",
    f"ENV PATH={DEFAULT_PATH}",
    'CMD ["/bin/sleep", "infinity"]',
    f"LABEL {SANDBOX_LABEL}=1",
]

_TOP_LEVEL_LINKS = ("bin", "lib", "lib64", "sbin")
_EMPTY_DIRS = ("usr", "tmp", "var", "var/tmp", "work", "etc", "proc", "sys",
               "dev", "root", "home", "run")


def _covered(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _host_binds() -> list[str]:
    """Host paths to bind-mount read-only (same path inside the container).

    * ``/usr``: bash, coreutils, procps, the system python3 and ``/usr/local``.
    * ``/bin``, ``/lib``, ``/lib64``, ``/sbin`` only where they are real
      directories (on merged-/usr hosts they are symlinks baked into the image).
    * the real prefixes of the running interpreter (a pyenv build such as
      ``/root/.pyenv/versions/3.11.7``, a venv and its base) where they are not
      under ``/usr``: the pip-installed packages (pytest, ...) live there.
    * the user site-packages directory if it exists, and ``/etc/ld.so.cache``
      and ``/etc/alternatives`` (Debian's ``/usr/bin`` symlinks point there).
    """
    binds: list[str] = ["/usr"]
    for d in _TOP_LEVEL_LINKS:
        p = "/" + d
        if os.path.isdir(p) and not os.path.islink(p):
            binds.append(p)
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
                os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    try:
        import site

        user_site = site.getusersitepackages()
        if user_site and os.path.isdir(user_site):
            prefixes.add(user_site)
    except Exception:  # pragma: no cover - site quirks
        pass
    for p in sorted({os.path.realpath(p) for p in prefixes if p}, key=len):
        if p in ("/", "") or not os.path.isdir(p):
            continue
        if not _covered(p, binds):
            binds.append(p)
    for f in ("/etc/ld.so.cache", "/etc/alternatives"):
        if os.path.exists(f):
            binds.append(f)
    return binds


def _sandbox_path() -> str:
    dirs: list[str] = []
    for exe in (sys.executable, os.path.realpath(sys.executable)):
        d = os.path.dirname(exe)
        if exe and d and d not in dirs:
            dirs.append(d)
    for d in DEFAULT_PATH.split(":"):
        if d not in dirs:
            dirs.append(d)
    return ":".join(dirs)


#: host paths bind-mounted read-only, at the same path, into every sandbox.
SANDBOX_BINDS: list[str] = _host_binds()
#: environment of every sandbox: the host interpreter's bin dir first on PATH.
SANDBOX_ENV: dict[str, str] = {"PATH": _sandbox_path(), "PYTHONDONTWRITEBYTECODE": "1"}


def sandbox_volumes(extra: dict[str, Any] | None = None) -> dict[str, dict[str, str]]:
    """``volumes=`` for ``client.containers.run``: :data:`SANDBOX_BINDS` read-only
    plus ``extra`` (``{host_path: {"bind": path, "mode": "rw"}}``)."""
    vols = {p: {"bind": p, "mode": "ro"} for p in SANDBOX_BINDS}
    vols.update(extra or {})
    return vols


def sandbox_run_kwargs(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``client.containers.run`` starting a detached,
    network-less sandbox that sleeps until removed; ``overrides`` win
    (``volumes`` are merged with the read-only binds)."""
    kw: dict[str, Any] = {
        "image": SANDBOX_IMAGE,
        "command": ["/bin/sleep", "infinity"],
        "detach": True,
        "network_mode": "none",
        "environment": dict(SANDBOX_ENV),
        "working_dir": "/work",
        "labels": {SANDBOX_LABEL: "1"},
    }
    extra_vols = overrides.pop("volumes", None)
    kw.update(overrides)
    kw["volumes"] = sandbox_volumes(extra_vols)
    return kw


def rootfs_tar() -> bytes:
    """The sandbox rootfs as an uncompressed tar (root-owned, no programs)."""
    buf = io.BytesIO()
    now = int(time.time())

    def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
        ti = tarfile.TarInfo(name)
        ti.type, ti.mode, ti.mtime, ti.uid, ti.gid = kind, mode, now, 0, 0
        ti.linkname = link
        ti.size = len(data)
        tar.addfile(ti, io.BytesIO(data) if data else None)

    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for d in _EMPTY_DIRS:
            add(d, tarfile.DIRTYPE, 0o1777 if d in ("tmp", "var/tmp") else 0o755)
        for d in _TOP_LEVEL_LINKS:
            p = "/" + d
            if os.path.islink(p):
                add(d, tarfile.SYMTYPE, 0o777, link=os.readlink(p))
            else:
                add(d, tarfile.DIRTYPE, 0o755)
        add("etc/passwd", tarfile.REGTYPE, 0o644,
            b"root:x:0:0:root:/root:/bin/bash\n"
            b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        add("etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\nnogroup:x:65534:\n")
    return buf.getvalue()


def ensure_image(client: Any, image: str = SANDBOX_IMAGE, force: bool = False) -> str:
    """Return the id of ``image``, importing the sandbox rootfs first if it is
    missing (or ``force``).  ``client`` is a ``docker.DockerClient``."""
    import docker  # lazy: the ``docker`` extra is optional

    if not force:
        try:
            return client.images.get(image).id
        except docker.errors.ImageNotFound:
            pass
    repo, _, tag = image.rpartition(":")
    if not repo or "/" in tag:  # no tag given
        repo, tag = image, "latest"
    client.api.import_image_from_data(rootfs_tar(), repository=repo, tag=tag,
                                      changes=IMAGE_CHANGES)
    return client.images.get(image).id


def engine_error(timeout: float = 5.0) -> str | None:
    """``None`` when a Docker Engine answers a ping, else why not."""
    try:
        import docker
    except ImportError as e:
        return f"docker SDK not installed ({e}); pip install '.[docker]'"
    try:
        client = docker.from_env(timeout=timeout)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as e:  # DockerException, ConnectionError, PermissionError...
        return f"{type(e).__name__}: {e}"
    return None


def update_cpus(client: Any, container_id: str, *, cpuset_cpus: str | None = None,
                nano_cpus: int | None = None) -> dict[str, Any]:
    """Resize a running container's CPU allocation in place.

    The SDK's ``container.update`` has no ``nano_cpus``, so this posts to the
    raw ``/containers/{id}/update`` endpoint."""
    data: dict[str, Any] = {}
    if cpuset_cpus is not None:
        data["CpusetCpus"] = cpuset_cpus
    if nano_cpus is not None:
        data["NanoCpus"] = int(nano_cpus)
    api = client.api
    res = api._post_json(api._url("/containers/{0}/update", container_id), data=data)
    return api._result(res, True)


def cgroup_v1_dir(container: Any, controller: str) -> str:
    """Host directory of a running container's cgroup-v1 ``controller``
    (e.g. ``/sys/fs/cgroup/cpu/docker/<id>``), read from the container's init
    process's ``/proc/<pid>/cgroup`` so a non-default cgroup parent works too."""
    container.reload()
    pid = container.attrs["State"]["Pid"]
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if controller in ctrls.split(","):
                base = f"/sys/fs/cgroup/{controller}"
                if not os.path.isdir(base):  # e.g. cpu mounted as cpu,cpuacct
                    base = f"/sys/fs/cgroup/{ctrls}"
                return base + path
    raise FileNotFoundError(f"no cgroup v1 {controller!r} controller for pid {pid}")
