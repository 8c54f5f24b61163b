"""The shell scripts the Docker executor runs inside its containers (bash: the host's, bound read-only).

Every process of an action is found, to be killed, by a mark in its
environment; these scripts set it, look for it and kill with it.
"""
from __future__ import annotations

# Every process of an action carries TANGRAM_ACTION_TOKEN=<token> in its
# environment (set on the exec, inherited by all descendants, even one that
# left the session with setsid): that is how the action's processes are found
# inside the container to kill them: every /proc/<pid>/environ holding an
# entry matching $want gets $sig. Bash builtins only (mapfile, [[ ]], kill):
# no fork, so it works when a fork bomb has used up the container's pids.
_MARKED = ('for e in /proc/[0-9]*/environ; do p=${e#/proc/}; p=${p%/environ}; [ "$p" = "$$" ] && continue; '
           '{ mapfile -d "" -t v < "$e"; } 2>/dev/null || continue; '
           'for x in "${v[@]}"; do if [[ $x == $want ]]; then kill -$sig $p 2>/dev/null; break; fi; done; done')

# $0 = the command, $1 = the token. Runs the command, then kills whatever it
# left running (background jobs, daemons) so the action's cores are free.
# The /proc scan (reading every process's environ) runs only when a process appeared that
# was not there before the command (bash globs and an associative array: no
# fork on the common path). The wrapper itself is not marked (its exec
# carries "<token>.w"): a kill leaves it alive to reap its child and end the
# exec cleanly; killing the exec's own process first makes the Docker Engine
# wait seconds on the orphaned output pipes before it serves the next exec.
WRAPPER = (
    "declare -A seen; for p in /proc/[0-9]*; do seen[$p]=1; done\n"
    "TANGRAM_ACTION_TOKEN=$1 bash -c \"$0\"\n"
    "rc=$?\n"
    "for p in /proc/[0-9]*; do if [ -z \"${seen[$p]}\" ]; then\n"
    "  want=\"TANGRAM_ACTION_TOKEN=$1\"; sig=KILL\n  " + _MARKED + "\n  break\nfi; done\n"
    "exit $rc\n"
)

# PID 1 of a sandbox: sleeps, and reaps the orphans a kill leaves behind (bash
# reaps any child in its SIGCHLD handler). The image has no init, and
# docker-init is not installed everywhere; ``sleep infinity`` would keep zombies.
# `|| exit 0`: if sleep cannot run any more (the container's root or binds are gone, e.g. its
# engine was killed and its state wiped), end the container instead of spinning on a failing fork
REAPER = ["/bin/bash", "-c", 'trap "exit 0" TERM; while :; do sleep 3600 & wait $! || exit 0; done']

# $1 = the token, $2 = the signal: signal every process of the action.
# With KILL a second pass catches a child forked while the first one ran.
KILLER = "want=\"TANGRAM_ACTION_TOKEN=$1\"; sig=$2\n" + _MARKED + "\n[ $sig = KILL ] && { " + _MARKED + "; }\nexit 0\n"
# every action's processes (a service that died left them): the wrappers too
KILL_ALL = "want='TANGRAM_ACTION_TOKEN=*'; sig=KILL\n" + _MARKED + "\nexit 0\n"
