"""Replicas: the same workload, its timing moved by a few milliseconds, to measure one run's noise.

The simulator is deterministic for a seed, so one run per seed says nothing of how far a
close result would move under the timing noise every real cluster has. Replica ``r`` (1,
2, ...) of a seed moves each generation gap of each trajectory by a draw in
``[-REPLICA_JITTER_S / 2, REPLICA_JITTER_S / 2)`` (never below zero) from a stream named by
the seed, ``r`` and the trajectory, so every policy run on replica ``r`` sees the same
perturbed work (the comparison stays like for like), and the API baselines' retry backoff
draws from its own stream per replica too. The moves average zero, so the replicas scatter
around the seed's own run (replica 0, unperturbed) rather than to one side of it. Only the
timing moves: the actions, their durations and the turns stay the seed's.
``scripts/noise_spread.py`` runs a point's policies on several replicas and judges each loss
against the spread.
"""
from __future__ import annotations

import random

# 10 ms wide: well below a turn's generation in every built-in workload (means of 3-60 s) and in the
# random families (means from 0.5 s), about the variation of one RPC between a rollout worker and the
# service; enough to reorder actions that arrive together, which is where one run's result is one
# draw of several
REPLICA_JITTER_S = 0.01


def jitter_stream(seed: int, replica: int) -> random.Random:
    """The retry backoff's stream: the seed's own for replica 0 (the stored runs reproduce)."""
    return random.Random(f"{seed}/jitter" if not replica else f"{seed}/jitter/replica-{replica}")


def perturb_generation(trajectories: list, seed: int, replica: int) -> list:
    """Move each generation gap (an item's ``gen_s``) of each trajectory in place by less than half
    of :data:`REPLICA_JITTER_S` either way (a gap never below zero), and return the list. A reward
    that follows the previous one with no generation (``gen_s`` 0) keeps it. Replica 0 is left as
    drawn."""
    if replica:
        for tr in trajectories:
            rng = random.Random(f"{seed}/replica-{replica}/{tr.id}")
            for it in tr.items:
                if it.gen_s > 0:
                    it.gen_s = max(0.0, it.gen_s + (rng.random() - 0.5) * REPLICA_JITTER_S)
    return trajectories
