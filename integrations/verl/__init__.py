"""verl integration: every external action of a verl rollout goes through the Tangram scheduler.

Modules (verl is imported only by the ones that need it, and only when used):

* :mod:`.config`        -- the flag and the service URL/token (config, env)
* :mod:`.session`       -- trajectory -> environment registry, shared clients, timings
* :mod:`.tools`         -- ``TangramSandboxTool`` (exec) and ``TangramApiTool`` (http)
* :mod:`.agent_loop`    -- the ``tangram_agent`` loop (env lifecycle, hands the last turn to the reward)
* :mod:`.reward`        -- async ``compute_score`` (test suites, reward models)
* :mod:`.reward_manager` -- the ``tangram`` reward manager
* :mod:`.metrics`       -- ``tangram/*`` step metrics into verl's logger
* :mod:`.guard`         -- stops the training when the service stays down (``max_consecutive_failures``)
* :mod:`.plugin`        -- the ``verl.plugins`` entry point
* :mod:`.testing`       -- offline test kit (byte-level tokenizer, scripted LLM server)
"""
from __future__ import annotations

import logging

log = logging.getLogger("integrations.verl")

_registered = False


def register() -> None:
    """Register ``tangram_agent`` (agent loop) and ``tangram`` (reward manager) with verl. Idempotent."""
    global _registered
    if _registered:
        return
    import integrations.verl.agent_loop  # noqa: F401  (@register("tangram_agent"))
    import integrations.verl.reward_manager  # noqa: F401  (@register("tangram"))
    from integrations.verl import guard
    from integrations.verl.config import settings_from_env
    from integrations.verl.metrics import install_logger_hook

    install_logger_hook()  # tangram/* metrics into the trainer's step metrics
    guard.install_hooks()  # a service that stays down stops the training (max_consecutive_failures)

    _registered = True
    s = settings_from_env()
    log.info("tangram: verl integration registered (agent loop 'tangram_agent', reward manager 'tangram'; "
             "service %s)", s.url)
