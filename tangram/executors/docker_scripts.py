"""The shell scripts the Docker executor runs inside its containers (bash: the host's, bound read-only).

An action's processes are found, to be killed, by what its command cannot undo
as well as by a mark it inherits. The mark: every process of an action starts
with ``TANGRAM_ACTION_TOKEN=<token>`` in its environment. A command can clear
it (``env -i``) and leave its session (``setsid``), so a sweep also follows
each process's parent links (``/proc/<pid>/stat``): a process descending from
one marked with the action's token is the action's, and one that nobody's
running exec leads to any more (orphaned: its parent is the container's PID 1)
is killed too, unless it carries the token of another action still running
(its wrapper, an exec of the engine, holds ``<token>.w`` and has parent 0,
which no process in the container can forge). PID 1 and its own children (its
session, which no other process can join) are never touched.
"""
from __future__ import annotations

# $want: the token to kill (a pattern: '*' for every action's), $sig: the signal.
# One pass reads every process's parent, session and token; then a process is
# signalled if its chain of parents meets $want before it meets the root of a
# running exec (parent 0) or the token of another running action, or if the
# chain ends at PID 1 (orphaned). Bash builtins only (read, mapfile, [[ ]],
# kill): no fork, so it works when a fork bomb has used up the container's pids.
_SWEEP = (
    'declare -A par sid tok live; procs=(/proc/[0-9]*); set -f\n'
    'for d in "${procs[@]}"; do p=${d#/proc/}; [ "$p" = "$$" ] && continue\n'
    '  { read -r st < "$d/stat"; } 2>/dev/null || continue\n'
    '  st=${st##*) }; f=($st); par[$p]=${f[1]}; sid[$p]=${f[3]}\n'
    '  { mapfile -d "" -t v < "$d/environ"; } 2>/dev/null || continue\n'
    '  for x in "${v[@]}"; do if [[ $x == TANGRAM_ACTION_TOKEN=* ]]; then tok[$p]=${x#*=}; break; fi; done\n'
    'done\n'
    'for p in "${!par[@]}"; do [ "${par[$p]}" = 0 ] && [[ ${tok[$p]} == *.w ]] && live[${tok[$p]%.w}]=1; done\n'
    'for p in "${!par[@]}"; do [ "${sid[$p]}" = 1 ] && continue; q=$p; hit=; n=0\n'
    '  while [ -n "$q" ] && [ $n -lt 4096 ]; do t=${tok[$q]}\n'
    '    if [ -n "$t" ]; then [[ $t == $want ]] && { hit=1; break; }; [ -n "${live[${t%.w}]}" ] && break; fi\n'
    '    q=${par[$q]}; [ "$q" = 0 ] && break; [ "$q" = 1 ] && { hit=1; break; }; n=$((n+1))\n'
    '  done\n'
    '  [ -n "$hit" ] && kill -$sig $p 2>/dev/null\n'
    'done\n'
    'set +f; unset par sid tok live\n'
)

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
    "  want=$1; sig=KILL\n" + _SWEEP + "  break\nfi; done\n"
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
KILLER = "want=$1; sig=$2\n" + _SWEEP + "[ $sig = KILL ] && {\n" + _SWEEP + "}\nexit 0\n"
# every action's processes (a service that died left them): the wrappers too, and every orphan
KILL_ALL = "want='*'; sig=KILL\n" + _SWEEP + "exit 0\n"
