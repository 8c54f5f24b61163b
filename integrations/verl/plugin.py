"""The ``verl.plugins`` entry point (``pyproject.toml``).

``import verl`` imports this module in every process (driver, Ray workers)
unless ``VERL_USE_EXTERNAL_PLUGINS=none``. When ``TANGRAM_ENABLED=1`` it
registers the integration at once: the ``tangram_agent`` agent loop and the
``tangram`` reward manager. verl swallows plugin errors at DEBUG level, so the
outcome is logged here (INFO on success, WARNING on failure).

The config flag (``+actor_rollout_ref.rollout.custom.tangram.enabled=true``)
is read later, when the agent loop / reward manager are built; processes that
only see the config get the names from
``rollout.agent.agent_loop_config_path=integrations/verl/examples/agent_loop.yaml``
and ``reward.reward_manager.source=importlib`` (see ``examples/run_grpo_tangram.sh``),
or call :func:`integrations.verl.register` themselves.
"""
from __future__ import annotations

import logging

from integrations.verl.config import env_flag

log = logging.getLogger("integrations.verl")

REGISTERED = False
if env_flag():
    try:
        from integrations.verl import register as _register

        _register()
        REGISTERED = True
    except Exception:  # never break `import verl`; say why instead
        log.warning("tangram: registering the verl integration failed", exc_info=True)
else:
    log.debug("tangram: verl plugin loaded, integration not enabled (TANGRAM_ENABLED unset)")
