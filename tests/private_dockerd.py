"""A private Docker Engine under a temporary directory: its own socket, data root, exec root and pid file.

Used where an engine must be killed or restarted (the fault suite, the scale-out
tests) without touching the machine's shared engine. Started with the same
flags as ``scripts/docker_engine.sh`` (no iptables, no bridge), with the
``vfs`` storage driver, which works on any file system (overlay on overlay
does not).

Laid out as distribution packages run the engine: ``containerd`` is a service
of its own (here: its own config, root, state and socket in our directory) and
``dockerd`` is given its socket (``--containerd``), so that ``dockerd`` dying
does not take containerd along.

* :meth:`kill_daemon`: SIGKILL to ``dockerd`` alone: the engine crashed;
  ``containerd``, shims and containers live on until it comes back (without
  ``live-restore`` the restarted engine then stops the containers, and starts
  those with a restart policy again).
* :meth:`kill`: the machine crashed: SIGKILL to dockerd, containerd, shims and
  every container process.
* :meth:`remove`: stop it, kill what is left, unmount and delete its directory.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Any, Callable

# containerd's own settings (``containerd config default``, trimmed): everything under our directory; no CRI
# (Kubernetes) plugin, no debug socket, no metrics
CONTAINERD_CONFIG = """version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{sock}"

[debug]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
"""
ENGINE_FLAGS = ("--iptables=false", "--ip6tables=false", "--bridge=none", "--storage-driver=vfs")


class PrivateDockerd:
    """One ``dockerd`` of our own, started and killed here."""

    def __init__(self, endpoint: str | None = None, extra: tuple[str, ...] = (),
                 connect: Callable[[], Any] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="tgd-", dir="/tmp")  # short: a unix socket path has 108 bytes
        self.sock = os.path.join(self.dir, "d.sock")
        self.endpoint = endpoint or f"unix://{self.sock}"
        self.extra = extra
        self.connect = connect
        self.pidfile = os.path.join(self.dir, "d.pid")
        self.containerd_sock = os.path.join(self.dir, "c.sock")
        self.proc: subprocess.Popen | None = None
        self.containerd: subprocess.Popen | None = None

    def client(self, timeout: float = 60):
        import docker

        return self.connect() if self.connect else docker.DockerClient(base_url=self.endpoint, timeout=timeout)

    def start(self, wait_s: float = 60.0) -> None:
        if os.path.exists(self.pidfile):
            os.unlink(self.pidfile)  # left by a killed daemon: dockerd refuses to start over it
        if not self.processes():
            # nothing of the old engine lives (a rebooted machine starts with an empty /run): neither dockerd
            # nor containerd may trust the dead ones' state
            remove_tree(os.path.join(self.dir, "exec"))
            remove_tree(os.path.join(self.dir, "containerd", "state"))
        if self.containerd is None or self.containerd.poll() is not None:
            self._start_containerd(wait_s)
        log = open(os.path.join(self.dir, "log"), "ab")
        self.proc = subprocess.Popen(
            ["dockerd", "--host", self.endpoint, "--data-root", os.path.join(self.dir, "data"),
             "--exec-root", os.path.join(self.dir, "exec"), "--pidfile", self.pidfile,
             "--containerd", self.containerd_sock, *ENGINE_FLAGS, *self.extra],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            env={**os.environ, "TMPDIR": self.dir})
        log.close()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                c = self.client(timeout=5)
                c.ping()
                c.close()
                return
            except Exception:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"private dockerd did not start: {self.tail()}")
                time.sleep(0.2)

    def _start_containerd(self, wait_s: float) -> None:
        """containerd as a service of its own: every path it writes is in our directory."""
        base = os.path.join(self.dir, "containerd")
        os.makedirs(base, exist_ok=True)
        config = os.path.join(base, "config.toml")
        with open(config, "w") as f:
            f.write(CONTAINERD_CONFIG.format(root=os.path.join(base, "root"), state=os.path.join(base, "state"),
                                             sock=self.containerd_sock, opt=os.path.join(base, "opt")))
        if os.path.exists(self.containerd_sock):
            os.unlink(self.containerd_sock)  # a killed one's: the wait below must see the new one's
        log = open(os.path.join(self.dir, "containerd.log"), "ab")
        self.containerd = subprocess.Popen(
            ["containerd", "--config", config], stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            start_new_session=True,  # not in dockerd's process group: a kill of dockerd leaves it running
            # its stack dumps and runc's exec specs go to $TMPDIR: keep them in our directory
            env={**os.environ, "TMPDIR": self.dir})
        log.close()
        deadline = time.monotonic() + wait_s
        while not os.path.exists(self.containerd_sock):
            if self.containerd.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"private containerd did not start: {self.tail('containerd.log')}")
            time.sleep(0.05)

    def kill_daemon(self) -> None:
        """SIGKILL to dockerd only (containerd and the containers keep running)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def kill(self) -> None:
        """The machine crashes: SIGKILL to this engine's dockerd, containerd, shims and containers, and
        their cgroups go, as with the reboot."""
        for proc in (self.proc, self.containerd):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        for _ in range(50):  # again until none is left: a dying containerd may have just spawned a shim
            pids = self.processes()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        self._remove_container_cgroups()

    def _remove_container_cgroups(self) -> None:
        """As the reboot after a crash would: the killed containers' cgroups go (nobody else removes them)."""
        try:
            ids = os.listdir(os.path.join(self.dir, "data", "containers"))
        except OSError:
            return
        deadline = time.monotonic() + 5
        for cid in ids:
            for ctrl in os.listdir("/sys/fs/cgroup"):
                d = os.path.join("/sys/fs/cgroup", ctrl, "docker", cid)
                while os.path.isdir(d):
                    try:
                        os.rmdir(d)  # empty once its killed processes are gone
                    except OSError:
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.05)

    def processes(self) -> list[int]:
        """Processes started for this engine: those naming its directory, and all their descendants."""
        parent: dict[int, int] = {}
        roots = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if self.dir.encode() in f.read():
                        roots.append(int(d))
            except (OSError, ValueError, IndexError):
                continue
        found = set(roots)
        grew = True
        while grew:
            grew = False
            for pid, pp in parent.items():
                if pp in found and pid not in found:
                    found.add(pid)
                    grew = True
        return sorted(found)

    def stop(self) -> None:
        for proc in (self.proc, self.containerd):  # dockerd first: it stops its containers through containerd
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    pass
        self.kill()  # whatever is left of it

    def remove(self) -> None:
        """Stop it and delete every trace: processes, mounts, its directory."""
        self.stop()
        remove_tree(self.dir)

    def tail(self, name: str = "log") -> str:
        try:
            with open(os.path.join(self.dir, name), "rb") as f:
                return f.read()[-1500:].decode(errors="replace")
        except OSError:
            return ""


def remove_tree(path: str) -> None:
    """rm -rf, after unmounting what dockerd mounted below ``path`` (its data root, network namespaces)."""
    with open("/proc/mounts") as f:
        points = [line.split()[1] for line in f]
    for mp in sorted((m for m in points if m == path or m.startswith(path.rstrip("/") + "/")), key=len, reverse=True):
        subprocess.run(["umount", "-l", mp], capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
