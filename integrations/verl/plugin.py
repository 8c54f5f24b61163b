"""The ``verl.plugins`` entry point (``pyproject.toml``).

``import verl`` imports this module in every process (driver, Ray workers)
unless ``VERL_USE_EXTERNAL_PLUGINS=none``. When ``TANGRAM_ENABLED=1`` it
registers the integration at once: the ``tangram_agent`` agent loop and the
``tangram`` reward manager. verl swallows plugin errors at DEBUG level, so the
outcome is logged here (INFO on success, WARNING on failure).

The config flag (``+actor_rollout_ref.rollout.custom.tangram.enabled=true``)
counts too when it is on this process's command line (the driver of
``python -m verl.trainer.main_ppo ...``): the plugin then also sets
``TANGRAM_ENABLED=1`` for the processes the driver starts. Otherwise the flag
is read later, when the agent loop / reward manager are built; processes that
only see the config get the names from
``rollout.agent.agent_loop_config_path=integrations/verl/examples/agent_loop.yaml``
and ``reward.reward_manager.source=importlib`` (see ``examples/run_grpo_tangram.sh``),
or call :func:`integrations.verl.register` themselves.
"""
from __future__ import annotations

import logging
import os
import re
import sys

from integrations.verl.config import env_flag

log = logging.getLogger("integrations.verl")

_ARGV_FLAG = re.compile(r"^\+{0,2}(?:actor_rollout_ref\.rollout\.custom\.)?tangram\.enabled=(?:true|1|yes|on)$", re.I)


def flag_in_argv(argv: list[str] | None = None) -> bool:
    """The Hydra override ``+actor_rollout_ref.rollout.custom.tangram.enabled=true`` (or
    ``+tangram.enabled=true``) on the command line of this process (the trainer's driver)."""
    return any(_ARGV_FLAG.match(a.strip()) for a in (sys.argv if argv is None else argv) if isinstance(a, str))


REGISTERED = False
if not env_flag() and flag_in_argv():
    # the driver saw the config flag: say so to every process it starts (a local Ray
    # cluster inherits this environment; remote nodes need ray_kwargs...env_vars, see
    # examples/run_grpo_tangram.sh)
    os.environ["TANGRAM_ENABLED"] = "1"
if env_flag():
    try:
        from integrations.verl import register as _register

        _register()
        REGISTERED = True
    except Exception:  # never break `import verl`; say why instead
        log.warning("tangram: registering the verl integration failed", exc_info=True)
else:
    log.debug("tangram: verl plugin loaded, integration not enabled (TANGRAM_ENABLED unset)")
