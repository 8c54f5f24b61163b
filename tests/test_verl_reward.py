"""Rewards through the scheduler for configurations that keep their own loop:
the async ``compute_score`` (loaded the way verl loads a custom reward function)
and the ``tangram`` reward manager (built by verl's ``load_reward_manager``),
scoring real pytest runs (``pytest -n ${parallel_num}``, elastic DoP from a
profile) and a reward model served on a (virtual, CPU) GPU node."""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("verl", reason="verl not installed: pip install -r scripts/test-requirements.txt")

from integrations.verl import config as tconfig  # noqa: E402
from integrations.verl import reward as R  # noqa: E402
from integrations.verl.session import close_clients  # noqa: E402
from integrations.verl.testing import make_model_dir, serve, verl_config  # noqa: E402
from tangram.service.wire import parse_action  # noqa: E402
from tangram.client import TangramClient  # noqa: E402

pytestmark = pytest.mark.verl

REWARD_PY = Path(R.__file__).resolve()
# the real suite, xdist with the allocated DoP (plugin autoload off: a 10x faster start)
SUITE = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -p xdist.plugin -q -n ${parallel_num}"
GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
HALF = "```python\ndef add(a, b):\n    return a + b if a >= 0 else 0\n```"
BAD = "def add(a, b):\n    return a - b\n"


@pytest.fixture(scope="module")
def project():
    """The setup_command writing a tiny real pytest project (the agent must write calc.py)."""
    from integrations.verl.testing import calc_setup_command

    return calc_setup_command()


# a profile for the suite's class: the scheduler may give it more than one core
CALC_PROFILE = {"pytest-calc": {"t1_s": 4.0, "efficiency": {"1": 1.0, "2": 0.95}, "samples": 5}}


def cluster_dir(d: Path, classes: dict, *, gpus: int, model: str, factory: str) -> Path:
    """``d/cluster.yaml`` (returned) with ``classes`` as its profiles and one (virtual, CPU) GPU node serving
    ``model`` from ``factory``."""
    (d / "profiles.json").write_text(json.dumps({"version": 1, "classes": classes}))
    (d / "cluster.yaml").write_text(
        "service: {max_body_bytes: 4194304}\n"  # a response of a megabyte and more, on the action's stdin
        "profiles: [profiles.json]\n"
        "gpu_nodes:\n"
        f"  - name: g0\n    gpus: {gpus}\n    device: cpu\n    memory_mb_per_gpu: 1024\n"
        f"    services:\n      - name: {model}\n"
        f"        options: {{factory: '{factory}'}}\n")
    return d / "cluster.yaml"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    cluster = cluster_dir(tmp_path_factory.mktemp("svc"), CALC_PROFILE, gpus=2, model="toy-rm",
                          factory="integrations.verl.testing:toy_reward_model")
    with serve(config=str(cluster)) as url:
        yield url


@pytest.fixture
def settings(service):
    s = tconfig.TangramSettings(enabled=True, url=service, reward_cpu_max=2)
    tconfig.set_active(s)
    yield s
    tconfig.set_active(None)


def _info(project, **kw):
    return {"tangram": {"setup_command": project, "solution_file": "calc.py",
                        "test_command": SUITE, "profile": "pytest-calc",
                        "cpu_max": 2, **kw}}


async def _stats(url):
    async with TangramClient(url) as c:
        return await c.stats()


async def test_compute_score_loaded_by_verl_scores_real_test_runs(settings, project, service, tmp_path):
    from verl.trainer.ppo.reward import get_custom_reward_fn

    cfg = verl_config(make_model_dir(tmp_path / "m"), [
        f"reward.custom_reward_function.path={REWARD_PY}", "reward.custom_reward_function.name=compute_score"])
    fn = get_custom_reward_fn(cfg)
    try:
        good = await fn(data_source="x", solution_str=GOOD, ground_truth=None, extra_info=_info(project))
        assert good["score"] == 1.0 and good["tangram_status"] == "succeeded"
        # elastic: the profile says 2 cores pay off and (on a machine with 2+) both are free
        assert good["tangram_dop"] == float(min(2, len(os.sched_getaffinity(0))))
        assert good["tangram_exec_s"] > 0 and good["tangram_queued_s"] >= 0
        frac = await fn(data_source="x", solution_str=HALF, ground_truth=None,
                        extra_info=_info(project, score="fraction"))
        assert frac["score"] == pytest.approx(2 / 3)
        # one-shot environments are gone with their action
        assert (await _stats(service))["environments"] == 0
    finally:
        await close_clients()


@pytest.mark.parametrize("form", ["flat keys of extra_info", "reward_model.tangram", "tools_kwargs in extra_info"])
async def test_every_spec_form_sets_up_the_reward_environment(settings, project, form):
    """The setup_command (which writes the project the tests import) runs in the reward's new environment
    whichever form the sample gives it in: it was once read from extra_info.tangram alone, and the tests
    ran in an empty directory and scored 0.0 with no error."""
    spec = _info(project)["tangram"]
    reward_model = None
    if form == "flat keys of extra_info":
        info = dict(spec)
    elif form == "reward_model.tangram":
        info, reward_model = {}, {"ground_truth": None, "tangram": dict(spec)}
    else:  # verl's dataset keeps tools_kwargs in extra_info; the spec names no setup itself
        setup = spec.pop("setup_command")
        info = {"tangram": spec, "tools_kwargs": {"run_shell": {"create_kwargs": {"setup_command": setup}}}}
    try:
        for text, want in ((GOOD, 1.0), (BAD, 0.0)):
            got = await R.compute_score("x", text, None, extra_info=info, reward_model=reward_model)
            assert got["score"] == want and got["tangram_status"] in ("succeeded", "failed"), (form, got)
    finally:
        await close_clients()


async def test_samples_without_a_tangram_spec_fall_back_to_verl_default_scoring(settings):
    score = await R.compute_score("openai/gsm8k", "... #### 42", "42", extra_info={})
    # verl's default scorer, and the same keys as a tangram-scored sample (verl stacks them per key)
    assert score["score"] == 1.0 and tuple(score) == R.REWARD_KEYS and score["tangram_status"] == "none"


async def test_compute_score_takes_the_service_from_reward_kwargs_and_the_token_from_a_file(
        project, tmp_path, monkeypatch):
    """The reward worker never sees the rollout config: verl hands compute_score its reward_kwargs."""
    from verl.trainer.ppo.reward import get_custom_reward_fn

    for var in ("TANGRAM_URL", "TANGRAM_TOKEN", "TANGRAM_TOKEN_FILE", "TANGRAM_ENABLED"):
        monkeypatch.delenv(var, raising=False)
    tconfig.set_active(None)
    info = _info(project)
    del info["tangram"]["profile"]  # a bare service: no profiles
    secret = "s3cr3t-" + os.urandom(4).hex()
    token_file = tmp_path / "token"
    token_file.write_text(secret + "\n")
    with serve(token=secret, tmp=tmp_path) as url:
        cfg = verl_config(make_model_dir(tmp_path / "m"), [
            f"reward.custom_reward_function.path={REWARD_PY}", "reward.custom_reward_function.name=compute_score",
            f"+reward.custom_reward_function.reward_kwargs.tangram_url={url}",
            f"+reward.custom_reward_function.reward_kwargs.tangram_token_file={token_file}"])
        from omegaconf import OmegaConf

        assert secret not in OmegaConf.to_yaml(cfg)  # what verl prints holds the path, not the token
        fn = get_custom_reward_fn(cfg)
        try:
            good = await fn(data_source="x", solution_str=GOOD, ground_truth=None, extra_info=info)
            assert good["score"] == 1.0
            # without the token file the service refuses, and the reward says so instead of scoring 0.0
            bad_cfg = verl_config(make_model_dir(tmp_path / "m2"), [
                f"reward.custom_reward_function.path={REWARD_PY}", "reward.custom_reward_function.name=compute_score",
                f"+reward.custom_reward_function.reward_kwargs.tangram_url={url}"])
            with pytest.raises(R.TangramServiceError, match="401") as e:
                await get_custom_reward_fn(bad_cfg)(data_source="x", solution_str=GOOD, ground_truth=None,
                                                    extra_info=info)
            assert url in str(e.value) and secret not in str(e.value)
        finally:
            await close_clients()


async def test_reward_manager_scores_a_batch_concurrently(settings, project, service, tmp_path):
    import numpy as np
    import torch
    from verl.protocol import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    import integrations.verl.reward_manager  # noqa: F401  (registers "tangram"; the plugin does it in real runs)

    model_dir = make_model_dir(tmp_path / "m")
    cfg = verl_config(model_dir, ["reward.reward_manager.name=tangram",
                                  "+actor_rollout_ref.rollout.custom.tangram.enabled=true",
                                  f"+actor_rollout_ref.rollout.custom.tangram.url={service}",
                                  "+actor_rollout_ref.rollout.custom.tangram.reward_cpu_max=2"])
    from integrations.verl.testing import make_tokenizer

    tok = make_tokenizer()
    mgr = load_reward_manager(cfg, tok)
    assert type(mgr).__name__ == "TangramRewardManager"

    def item(text, info):
        p = tok.encode("<|im_start|>user\nwrite add<|im_end|>\n", add_special_tokens=False)
        r = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        resp = torch.tensor([r + [tok.pad_token_id] * 5])
        mask = torch.tensor([[1] * len(p) + [1] * len(r) + [0] * 5])
        return DataProto.from_dict(
            tensors={"prompts": torch.tensor([p]), "responses": resp, "attention_mask": mask},
            non_tensors={"data_source": np.array(["x"], dtype=object),
                         "reward_model": np.array([{"ground_truth": None}], dtype=object),
                         "extra_info": np.array([info], dtype=object)})

    try:
        outs = await asyncio.gather(*[mgr.run_single(item(t, _info(project))) for t in (GOOD, BAD)])
        assert [o["reward_score"] for o in outs] == [1.0, 0.0]
        assert outs[1]["reward_extra_info"]["tangram_status"] == "failed"  # exit code 1: a verdict
        assert all(o["reward_extra_info"]["tangram_dop"] in (1.0, 2.0) for o in outs)
        assert (await _stats(service))["environments"] == 0

        # a reward model on the (virtual) GPU node: one `model` action per sample
        rm = {"tangram": {"model": "toy-rm", "op": "score", "gpu": 1}}
        outs = await asyncio.gather(*[mgr.run_single(item(t, rm)) for t in ("fine.", "great!!", "wow!!!!")])
        assert [o["reward_score"] for o in outs] == [0.0, 2.0, 4.0]
        assert all(o["reward_extra_info"]["tangram_status"] == "succeeded" for o in outs)
        st = await _stats(service)
        assert st["actions"].get("model:succeeded", 0) >= 3
    finally:
        await close_clients()


def _sample(tok, turns, *, data_source="openai/gsm8k", ground_truth="42", info=None, num_turns=None):
    """One sample as verl's v1 reward path hands it over: its response the turns' tokens back to back (tool
    outputs among them), no response_mask, ``__num_turns__`` counted as verl counts it."""
    import numpy as np
    import torch
    from verl.protocol import DataProto

    p = tok.encode("<|im_start|>user\nsolve it<|im_end|>\n", add_special_tokens=False)
    r = [t for turn in turns for t in tok.encode(turn, add_special_tokens=False)] + [tok.eos_token_id]
    return DataProto.from_dict(
        tensors={"prompts": torch.tensor([p]), "responses": torch.tensor([r + [tok.pad_token_id] * 3]),
                 "attention_mask": torch.tensor([[1] * (len(p) + len(r)) + [0] * 3])},
        non_tensors={"data_source": np.array([data_source], dtype=object),
                     "reward_model": np.array([{"ground_truth": ground_truth}], dtype=object),
                     "extra_info": np.array([info or {}], dtype=object),
                     "__num_turns__": np.array([num_turns or 2 * len(turns)], dtype=object)})


async def test_samples_without_a_spec_get_exactly_what_verls_naive_manager_gives(settings, service, tmp_path):
    """The tangram manager on a sample without a tangram spec (the default agent loop is tangram_agent, so
    every sample of a mixed dataset reaches it) against verl's own naive manager, built the same way:
    the same score and every one of verl's result keys, with verl's values. It once decoded the last turn
    only (0.0 where the answer was in an earlier one), refused a multi-turn sample without a
    response_mask, and wrote acc = score over a scorer's own acc."""
    from verl.trainer.ppo.reward import load_reward_manager

    import integrations.verl.reward_manager  # noqa: F401
    from integrations.verl.testing import make_tokenizer

    tok = make_tokenizer()
    scorer = tmp_path / "dapo_like.py"
    scorer.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kw):\n"
                      "    ok = solution_str.strip().endswith(str(ground_truth))\n"
                      "    return {'score': 1.0 if ok else -1.0, 'acc': ok, 'pred': solution_str.strip()[-2:],\n"
                      "            'turns': extra_info['num_turns']}\n")
    custom = [f"reward.custom_reward_function.path={scorer}", "reward.custom_reward_function.name=compute_score"]
    samples = [
        _sample(tok, ["First: 6 * 7 #### 42 <tool_call>check</tool_call>", "\ntool: ok\n", "Verified."]),
        _sample(tok, ["#### 41"]),
        _sample(tok, ["I think #### 42"], num_turns=2),
    ]
    for extra in ([], custom):
        model_dir = make_model_dir(tmp_path / f"m{len(extra)}")
        naive = load_reward_manager(verl_config(model_dir, ["reward.reward_manager.name=naive", *extra]), tok)
        ours = load_reward_manager(verl_config(model_dir, ["reward.reward_manager.name=tangram", *extra]), tok)
        for sample in samples:
            want, got = await naive.run_single(sample), await ours.run_single(sample)
            assert got["reward_score"] == want["reward_score"], (extra, want, got)
            mine = {k: v for k, v in got["reward_extra_info"].items() if k in want["reward_extra_info"]}
            assert mine == want["reward_extra_info"], (extra, want, got)
            assert got["reward_extra_info"]["tangram_status"] == "none"
    assert (await ours.run_single(samples[2]))["reward_extra_info"]["acc"] is True  # the scorer's, not the score


async def test_a_sample_verl_scores_still_releases_its_environment_and_fails_on_a_broken_rollout(
        settings, service, tmp_path):
    """A sample without a tangram spec whose rollout used the sandbox (the tangram_agent loop handed its
    environment over): verl's scorer scores it, and the environment is deleted (it once leaked, one per
    trajectory, out of the idle sweep's reach); if a tool call failed in the service the sample raises
    instead of being scored, on both the manager and the compute_score path."""
    import numpy as np
    from verl.trainer.ppo.reward import load_reward_manager

    import integrations.verl.reward_manager  # noqa: F401
    from integrations.verl.testing import make_tokenizer

    tok = make_tokenizer()
    mgr = load_reward_manager(verl_config(make_model_dir(tmp_path / "m"), [
        "reward.reward_manager.name=tangram", f"+actor_rollout_ref.rollout.custom.tangram.url={service}"]), tok)
    try:
        async with TangramClient(service) as c:
            for path in ("manager", "compute_score"):
                for broken in (False, True):
                    env = await c.create_environment()
                    fields = {"tangram_environment": env, "tangram_url": service}
                    if broken:
                        fields["tangram_error"] = "tool run_shell: HTTP 502: bad gateway"
                    sample = _sample(tok, ["#### 42"])
                    sample.non_tensor_batch["tool_extra_fields"] = np.array([fields], dtype=object)
                    if path == "manager":
                        run = mgr.run_single(sample)
                    else:
                        run = R.compute_score("openai/gsm8k", "#### 42", "42", extra_info=dict(fields))
                    if broken:
                        with pytest.raises(R.TangramServiceError, match="lost an action"):
                            await run
                    else:
                        out = await run
                        assert (out["reward_score"] if path == "manager" else out["score"]) == 1.0
                    listed = (await c._request("GET", "/v1/environments"))["environments"]
                    assert env not in {e["id"] for e in listed}, (path, broken)
    finally:
        await close_clients()


async def test_a_reward_models_prompt_is_the_samples_question(settings, service, tmp_path):
    """``{prompt}`` in a reward model's template: the dataset's extra_info.prompt, else the sample's own
    prompt tokens decoded (it was once an empty string unless extra_info had one, and the reward model
    scored the response without its question); compute_score, which verl hands no prompt tokens, refuses
    a template naming ``{prompt}`` without extra_info.prompt. The toy reward model counts ``!``."""
    import numpy as np
    import torch
    from verl.protocol import DataProto
    from verl.trainer.ppo.reward import load_reward_manager

    import integrations.verl.reward_manager  # noqa: F401
    from integrations.verl.testing import make_tokenizer

    tok = make_tokenizer()
    mgr = load_reward_manager(verl_config(make_model_dir(tmp_path / "m"), [
        "reward.reward_manager.name=tangram", f"+actor_rollout_ref.rollout.custom.tangram.url={service}"]), tok)
    rm = {"tangram": {"model": "toy-rm", "op": "score", "gpu": 1, "template": "{prompt} => {response}"}}

    def sample(info):
        p = [tok.pad_token_id] * 2 + tok.encode("why?!!", add_special_tokens=False)  # left-padded
        r = tok.encode("because!", add_special_tokens=False) + [tok.eos_token_id]
        return DataProto.from_dict(
            tensors={"prompts": torch.tensor([p]), "responses": torch.tensor([r]),
                     "attention_mask": torch.tensor([[0, 0] + [1] * (len(p) - 2) + [1] * len(r)])},
            non_tensors={"data_source": np.array(["x"], dtype=object),
                         "reward_model": np.array([{"ground_truth": None}], dtype=object),
                         "extra_info": np.array([info], dtype=object)})

    try:
        assert (await mgr.run_single(sample(rm)))["reward_score"] == 3.0  # "why?!!" and "because!"
        given = {**rm, "prompt": "told!!!!"}
        assert (await mgr.run_single(sample(given)))["reward_score"] == 5.0  # the dataset's prompt wins
        with pytest.raises(ValueError, match=r"uses \{prompt\} but the sample gives no prompt"):
            await R.compute_score("x", "because!", None, extra_info=rm)
        assert (await R.compute_score("x", "because!", None, extra_info=given))["score"] == 5.0
    finally:
        await close_clients()


async def test_a_sandbox_fusion_scorer_is_not_a_custom_function(settings, service, project, tmp_path):
    """With ``reward.sandbox_fusion.url`` set verl hands every manager a partial of its default scorer;
    that is no custom reward function, so samples with a tangram spec are still scored by the service (the
    partial once sent them to verl's default scorer instead)."""
    from verl.trainer.ppo.reward import load_reward_manager

    import integrations.verl.reward_manager  # noqa: F401
    from integrations.verl.testing import make_tokenizer

    tok = make_tokenizer()
    cfg = verl_config(make_model_dir(tmp_path / "m"), [
        "reward.reward_manager.name=tangram", "+reward.sandbox_fusion.url=http://127.0.0.1:1/run_code",
        f"+actor_rollout_ref.rollout.custom.tangram.url={service}",
        "+actor_rollout_ref.rollout.custom.tangram.reward_cpu_max=2"])
    mgr = load_reward_manager(cfg, tok)
    assert mgr.custom_score is None and mgr.naive_score is not None
    try:
        out = await mgr.run_single(_sample(tok, [GOOD], data_source="x", ground_truth=None, info=_info(project)))
        assert out["reward_score"] == 1.0 and out["reward_extra_info"]["tangram_status"] == "succeeded"
    finally:
        await close_clients()


async def test_a_response_of_a_megabyte_reaches_solution_file_byte_for_byte(settings, project):
    """The response once went in an env variable: past 32 KiB (the service's cap on one) the reward action
    was refused (400), and past 128 KiB (Linux's on one string) its command could not start."""
    filler = "".join(f"# {i} 'q' \"dq\" $HOME ${{x}} `t` \\ %s é 中\n" for i in range(25_000))
    text = "def add(a, b):\n    return a + b\n" + filler + "# no newline at the end"
    assert len(text.encode()) > 1 << 20
    digest = hashlib.sha256(text.encode()).hexdigest()
    try:
        got = await R.compute_score("x", text, None, extra_info=_info(
            project, test_command=f"echo '{digest}  calc.py' | sha256sum -c --quiet - && {SUITE}"))
        assert got["score"] == 1.0 and got["tangram_status"] == "succeeded", got
        bad = await R.compute_score("x", BAD + filler, None, extra_info=_info(project))
        assert bad["score"] == 0.0 and bad["tangram_status"] == "failed"
    finally:
        await close_clients()


async def test_reward_errors_raise_naming_the_service_and_the_cause(settings, service):
    try:
        with pytest.raises(R.TangramServiceError, match="unknown model") as e:
            await R.run_reward({"model": "no-such-model"}, settings=settings, solution="x")
        assert service in str(e.value)
    finally:
        await close_clients()


def test_action_bodies_follow_the_wire_contract():
    s = tconfig.TangramSettings(reward_cpu_max=8, reward_timeout_s=300)
    body = R.suite_action({"test_command": "pytest -n ${parallel_num}", "profile": "p", "setup_command": "cp -r /r/. .",
                           "solution_file": "sol.py"}, s, solution=GOOD)
    assert body["kind"] == "exec" and body["resources"] == {"cpu": {"min": 1, "max": 8}} and body["profile"] == "p"
    assert body["stdin"] == "def add(a, b):\n    return a + b\n" and "env" not in body
    assert bytes(parse_action(body)["payload"]["stdin"]) == body["stdin"].encode()
    # each step a brace group closed on its own line; the setup leaves stdin alone; the write checks the length
    assert body["command"] == ("{ cp -r /r/. .\n} < /dev/null && "
                               "{ cat > sol.py && [ \"$(wc -c < sol.py)\" -eq 32 ] || { echo 'tangram: cannot write "
                               "solution_file sol.py: unwritable, or short of the response'\"'\"'s 32 bytes' >&2; "
                               "exit 86; }\n} && { pytest -n ${parallel_num}\n}") and "environment" not in body
    in_env = R.suite_action({"test_command": "make test", "setup_command": "x", "cpu_max": 1}, s, environment="env-1")
    assert in_env["command"] == "make test" and in_env["environment"] == "env-1" and in_env["resources"]["cpu"] == 1
    assert "restartable" not in body and "restartable" not in in_env
    again = R.suite_action({"test_command": "pytest", "restartable": True}, s, environment="env-1")
    assert again["restartable"] is True
    assert parse_action(again)["restartable"] is True  # what the service accepts
    m = R.model_action({"model": "rm", "gpu": [1, 2], "template": "{prompt}|{response}"}, prompt="p", response="r",
                       ground_truth=None)
    assert m == {"kind": "model", "model": "rm", "op": "score", "inputs": ["p|r"], "resources": {"gpu": [1, 2]}}
    assert R.model_score([[0.5]]) == 0.5 and R.model_score({"scores": [2]}) == 2.0
    assert R.pytest_counts("x\n2 passed, 1 failed in 0.3s\n") == {"passed": 2, "failed": 1}


def test_a_model_reward_names_the_trajectory_it_scores():
    from integrations.verl.reward import model_action

    spec = {"model": "judge", "template": "{response}"}
    assert model_action(spec, prompt="", response="r", ground_truth=None, trajectory="env-1")["trajectory"] == "env-1"
    assert "trajectory" not in model_action(spec, prompt="", response="r", ground_truth=None)


# test and setup commands as people write them, each once a bash syntax error (exit 2: scored 0.0 for every
# response) inside the chain `{ CMD ; } && ...`: (setup, test) with the check of the response last
QUIET = "PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 pytest -q -p no:cacheprovider"
FORMS = {
    "a trailing newline (a YAML | block)": ("{setup}\n", "{test}\n"),
    "a trailing ;": ("{setup};", "{test};"),
    "a trailing comment": ("{setup}  # write the project", "{test}  # run the suite"),
    "a here-document": ("sh <<'EOF'\n{setup}\nEOF", "sh <<'EOF'\n{test}\nEOF"),
    "a trailing & (a setup that starts a daemon)": ("{setup}\nsleep 0 &", "{test}"),
}  # (a test command ending in & exits 0 whatever its tests do: no form of one)


def _run_alone_and_chained(spec, solution):
    """The exit status of a suite body's command under bash (what every executor runs) and under dash."""
    import subprocess
    import tempfile

    body = R.suite_action(spec, tconfig.TangramSettings(), solution=solution)
    codes = set()
    for shell in ("bash", "sh"):
        with tempfile.TemporaryDirectory() as d:
            codes.add(subprocess.run([shell, "-c", body["command"]], input=(body.get("stdin") or "").encode(),
                                     cwd=d, capture_output=True, timeout=30).returncode)
    return codes


@pytest.mark.parametrize("form", list(FORMS))
def test_a_step_chain_runs_each_command_as_it_would_alone(form):
    setup, test = FORMS[form]
    check = 'grep -qx "def good(): pass" sol.py && test -s made'
    spec = {"setup_command": setup.format(setup="echo made > made"), "solution_file": "sol.py",
            "test_command": test.format(test=check)}
    assert _run_alone_and_chained(spec, "def good(): pass") == {0}
    assert _run_alone_and_chained(spec, "def bad(): pass") == {1}
    alone = {"test_command": test.format(test="test -s made"), "cpu_max": 1}  # no steps: the command as given
    assert R.suite_action(alone, tconfig.TangramSettings(), environment="e")["command"] == alone["test_command"]


@pytest.mark.parametrize("form", list(FORMS))
async def test_each_command_form_scores_the_response_in_a_real_service(settings, project, form):
    setup, test = FORMS[form]
    spec = {**_info(project)["tangram"], "setup_command": setup.format(setup=project),
            "test_command": test.format(test=QUIET)}
    try:
        for text, want in ((GOOD, 1.0), (BAD, 0.0)):
            got, _ = await R.run_reward(spec, settings=settings, solution=text)  # setup, write, tests: one action
            assert got["score"] == want, (form, text, got)
    finally:
        await close_clients()


def test_a_null_max_consecutive_failures_in_reward_kwargs_turns_the_guard_off():
    """It was dropped as unset, and the guard stayed at 32 where null means never."""
    tconfig.set_active(tconfig.TangramSettings(max_consecutive_failures=5))
    try:
        assert R._settings({"tangram_max_consecutive_failures": None}).max_consecutive_failures == 0
        assert R._settings({"tangram_max_consecutive_failures": 3}).max_consecutive_failures == 3
        kept = R._settings({"tangram_url": None, "tangram_token_file": "", "tangram_max_consecutive_failures": ""})
        assert (kept.url, kept.max_consecutive_failures) == (tconfig.DEFAULT_URL, 5)  # null elsewhere: unset
    finally:
        tconfig.set_active(None)
