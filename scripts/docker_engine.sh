#!/usr/bin/env bash
# Ensure a Docker Engine answers on this machine, and that the local sandbox
# image (tangram-sandbox:latest) exists.  Idempotent: if `docker info` already
# works, no engine is installed or started.
#
#   1. `docker info` works            -> nothing to start
#   2. no `dockerd` binary            -> apt-get update && apt-get install docker.io
#   3. start dockerd in the background (setsid + nohup, log /tmp/tangram-dockerd.log):
#        dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver=overlay2
#      (no bridge network: containers must use network_mode="none")
#   4. wait up to ${TANGRAM_DOCKERD_WAIT:-60} s for `docker info`
#   5. bash scripts/build_sandbox_image.sh  (no registry is reachable: the
#      image is a `docker import` of a tiny local rootfs, see that script)
#
# Exit 0 when the engine is up and the image exists, non-zero with a message
# on stderr otherwise (no root to install/start it, dockerd died, ...).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
log=/tmp/tangram-dockerd.log
wait_s="${TANGRAM_DOCKERD_WAIT:-60}"

die() { echo "docker_engine.sh: $*" >&2; exit 1; }
engine_up() { docker info >/dev/null 2>&1; }

if ! engine_up; then
    if [ "$(id -u)" -ne 0 ]; then
        reason="$(docker info 2>&1 | tail -n 3 || true)"
        die "no Docker Engine answers and we are not root, so none can be installed/started here. docker info said: ${reason:-docker CLI missing}"
    fi

    if ! command -v dockerd >/dev/null 2>&1; then
        echo "docker_engine.sh: dockerd missing; installing docker.io via apt" >&2
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -q >/dev/null || die "apt-get update failed"
        apt-get install -y -q --no-install-recommends docker.io >/dev/null \
            || die "apt-get install docker.io failed"
        command -v dockerd >/dev/null 2>&1 || die "docker.io installed but no dockerd on PATH"
    fi

    if pgrep -x dockerd >/dev/null 2>&1; then
        echo "docker_engine.sh: a dockerd is already running; waiting for it" >&2
    else
        echo "docker_engine.sh: starting dockerd (log: $log)" >&2
        # setsid + nohup: the daemon survives this script and the test run.
        setsid nohup dockerd --iptables=false --ip6tables=false --bridge=none \
            --storage-driver=overlay2 >>"$log" 2>&1 < /dev/null &
        disown || true
    fi

    for _ in $(seq 1 "$wait_s"); do
        engine_up && break
        sleep 1
    done
    engine_up || die "dockerd did not answer within ${wait_s}s; last lines of $log:
$(tail -n 20 "$log" 2>/dev/null || true)"
fi

echo "docker_engine.sh: Docker Engine up ($(docker version --format '{{.Server.Version}}' 2>/dev/null || echo '?'))" >&2
bash "$here/build_sandbox_image.sh"
