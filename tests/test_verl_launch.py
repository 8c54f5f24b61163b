"""The launch documented in integrations/verl/README.md, checked against verl itself:
its overrides composed with verl's Hydra config (the token stays out of what verl prints),
then verl's Ray runtime_env built from them on a Ray cluster whose nodes were started
without any TANGRAM_* variable (as `ray start` nodes are): without the runtime_env the
reward workers do not know the `tangram` manager; with it every worker registers the
integration, installs the metrics hook and reaches the service with the token file."""
from __future__ import annotations

import os
import re
import shlex
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")
ray = pytest.importorskip("ray")

from integrations.verl.testing import make_model_dir, serve  # noqa: E402
from tests.helpers import ray_shutdown, stop_ray_and_remove  # noqa: E402

pytestmark = [pytest.mark.verl, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "integrations" / "verl" / "README.md"


def readme_overrides(env: dict[str, str]) -> list[str]:
    """The Hydra overrides of the README's `python3 -m verl.trainer.main_ppo` block, as the shell passes them."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S) if "verl.trainer.main_ppo" in b)
    cmd = block[block.index("python3 -m verl.trainer.main_ppo"):].replace("\\\n", " ")
    cmd = re.sub(r"\.\.\.\s*#.*", "", cmd)
    cmd = re.sub(r"\$(\w+)", lambda m: env[m.group(1)], cmd)
    return shlex.split(cmd)[3:]


def compose(model_dir: Path, overrides: list[str]):
    import verl
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    conf_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=conf_dir, version_base=None):
        return hydra_compose(config_name="ppo_trainer",
                             overrides=[f"actor_rollout_ref.model.path={model_dir}", *overrides])


def probe(cfg):
    """What a reward worker / the trainer of the job finds in its own process."""
    import asyncio

    import verl  # noqa: F401  (runs the verl.plugins entry points, as in every verl process)
    from verl.trainer.ppo.reward import resolve_reward_manager_cls
    from verl.utils.tracking import Tracking

    from integrations.verl.config import settings_from_config, token_in_config
    from tangram.client import TangramClient

    try:
        manager = resolve_reward_manager_cls(cfg).__name__
    except Exception as exc:  # noqa: BLE001 - reported to the test
        manager = f"error: {exc}"
    s = settings_from_config(cfg)

    async def stats():
        async with TangramClient(s.url, token=s.token, token_file=s.token_file) as c:
            return (await c.stats())["environments"]

    return {"manager": manager, "hook": Tracking.log.__name__, "enabled": os.environ.get("TANGRAM_ENABLED"),
            "environments": asyncio.run(stats()) if manager == "TangramRewardManager" else None}


def test_readme_launch_composes_with_verl_and_reaches_ray_start_workers(tmp_path, monkeypatch):
    from omegaconf import OmegaConf
    from ray.cluster_utils import Cluster
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env
    from verl.tools.tool_registry import load_all_tools

    from integrations.verl.config import settings_from_config, token_in_config

    for var in ("TANGRAM_ENABLED", "TANGRAM_URL", "TANGRAM_TOKEN", "TANGRAM_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.chdir(ROOT)  # the README's paths are relative to the repository
    secret = "tok-" + os.urandom(6).hex()
    token_file = tmp_path / "token"
    token_file.write_text(secret)
    with serve(token=secret, tmp=tmp_path) as url:
        cfg = compose(make_model_dir(tmp_path / "m"), readme_overrides({"TANGRAM_URL": url,
                                                                         "TANGRAM_TOKEN_FILE": str(token_file)}))
        s = settings_from_config(cfg)
        assert s.enabled and s.url == url and s.token_file == str(token_file) and s.token is None
        assert secret not in OmegaConf.to_yaml(cfg)  # what verl prints at start
        assert not token_in_config(cfg)
        assert token_in_config(compose(tmp_path / "m", ["+actor_rollout_ref.rollout.custom.tangram.token=x"]))
        assert cfg.trainer.use_v1  # verl's default path
        assert cfg.reward.reward_manager.name == "tangram"
        tools = load_all_tools(tool_config_path=cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path,
                               function_tool_path=None)
        assert max(int(t.config.get("max_output_chars") or 0) for t in tools) \
            <= cfg.actor_rollout_ref.rollout.multi_turn.max_tool_response_length
        runtime_env = OmegaConf.to_container(OmegaConf.merge(get_ppo_ray_runtime_env(cfg),
                                                             cfg.ray_kwargs.ray_init.runtime_env))
        assert runtime_env["env_vars"]["TANGRAM_ENABLED"] == "1" and secret not in str(runtime_env)

        if ray.is_initialized():
            ray.shutdown()
        tmp = tempfile.mkdtemp(prefix="tgl-", dir="/tmp")  # short: Ray's unix socket paths
        # `Cluster` writes its address file to the default Ray dir ($RAY_TMPDIR, else $TMPDIR or /tmp,
        # + /ray) whatever `temp_dir` says, and that dir exists only where Ray ran before: keep all of
        # it under our own temp root (removed below), as on a fresh machine
        monkeypatch.setenv("RAY_TMPDIR", tmp)
        os.makedirs(os.path.join(tmp, "ray"))
        cluster = None
        remote = ray.remote(num_cpus=0)(probe)
        try:
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "temp_dir": os.path.join(tmp, "ray"),
                                                                    "include_dashboard": False})
            ray.init(address=cluster.address)  # the driver's own environment says nothing of tangram
            without = ray.get(remote.remote(cfg), timeout=120)
            ray.shutdown()
            assert without["manager"].startswith("error:") and "tangram" in without["manager"]
            ray.init(address=cluster.address, runtime_env=runtime_env)
            got = ray.get(remote.remote(cfg), timeout=120)
            assert got == {"manager": "TangramRewardManager", "hook": "log_with_tangram", "enabled": "1",
                           "environments": 0}
        finally:
            stop_ray_and_remove(tmp, ray_shutdown(cluster))
