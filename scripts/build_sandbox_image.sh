#!/usr/bin/env bash
# Build the local sandbox image tangram-sandbox:latest if it is missing
# (`--force` rebuilds).  No Docker registry is reachable, so the image is a
# `docker import` of a tiny rootfs holding only empty mount points, a minimal
# /etc/passwd + /etc/group, and /bin /lib /lib64 /sbin laid out like the host's
# (symlinks into /usr on merged-/usr Debian).
#
# The image contains NO programs: containers must bind-mount the host's
# userland read-only, exactly as tangram/executors/docker_image.py does
# (SANDBOX_BINDS / sandbox_run_kwargs()):
#   /usr                                 (ro)  bash, coreutils, procps, system python3
#   /bin /lib /lib64 /sbin               (ro)  only where the host has real dirs, not symlinks
#   realpath of the host python's prefix (ro)  e.g. /root/.pyenv/versions/3.11.7
#       (and of a venv's prefix, and ~/.local if it has site-packages)
# and put that python's bin dir first on PATH, e.g.
#   docker run --rm --network none \
#     -v /usr:/usr:ro -v /root/.pyenv/versions/3.11.7:/root/.pyenv/versions/3.11.7:ro \
#     -e PATH=/root/.pyenv/versions/3.11.7/bin:/usr/local/bin:/usr/bin:/bin \
#     tangram-sandbox:latest python3 -c 'print(1+1)'
# Keep the rootfs in sync with ensure_image() in tangram/executors/docker_image.py.
set -euo pipefail

image="${TANGRAM_SANDBOX_IMAGE:-tangram-sandbox:latest}"

if [ "${1:-}" != "--force" ] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "build_sandbox_image.sh: $image present" >&2
    exit 0
fi

root="$(mktemp -d /tmp/tangram-rootfs.XXXXXX)"
trap 'rm -rf "$root"' EXIT

mkdir -p "$root"/{usr,tmp,var/tmp,work,etc,proc,sys,dev,root,home,run}
chmod 1777 "$root/tmp" "$root/var/tmp"
for d in bin lib lib64 sbin; do
    if [ -L "/$d" ]; then
        ln -s "$(readlink "/$d")" "$root/$d"
    else
        mkdir -p "$root/$d"
    fi
done
printf 'root:x:0:0:root:/root:/bin/bash\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"

tar --numeric-owner --owner=0 --group=0 -C "$root" -cf - . |
    docker import \
        --change 'WORKDIR /work' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/bin/sleep", "infinity"]' \
        --change 'LABEL org.arl-tangram.sandbox=1' \
        --message 'ARL-Tangram sandbox rootfs (bind-mount the host /usr read-only)' \
        - "$image" >/dev/null
echo "build_sandbox_image.sh: built $image" >&2
