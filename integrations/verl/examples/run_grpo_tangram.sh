#!/usr/bin/env bash
# GRPO on a coding dataset with every external action on the Tangram scheduler.
# (A documented launch command; not run by the tests.)
#
#   1. start the service on a CPU node:   tangram serve --config cluster.yaml   (or no config: this machine)
#   2. dataset rows (parquet) carry:
#        agent_name: tangram_agent
#        extra_info.tangram: {setup_command: "cp -r /data/repos/X/. .",
#                             test_command: "pytest -q -n ${parallel_num}",
#                             profile: "pytest-X", cpu_max: 8}
#      (datasets_patch rewrites `pytest` into `pytest -n ${parallel_num}` for you.)
#   3. bash integrations/verl/examples/run_grpo_tangram.sh [more hydra overrides]
#
# Every sample is scored by the `tangram` reward manager in verl's reward workers (the
# last generated turn, in the trajectory's own environment). A config that keeps verl's
# own manager can use the reward function alone instead (the service via reward_kwargs):
#     reward.custom_reward_function.path=integrations/verl/reward.py
#     reward.custom_reward_function.name=compute_score
#     +reward.custom_reward_function.reward_kwargs.tangram_url=$TANGRAM_URL
#     +reward.custom_reward_function.reward_kwargs.tangram_token_file=$TANGRAM_TOKEN_FILE
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# The service and a file holding its token, readable on every node (the token itself never goes
# into the config: verl prints it). `tangram serve` writes its token to ~/.config/tangram/token.
export TANGRAM_URL="${TANGRAM_URL:-http://127.0.0.1:8471}"
export TANGRAM_TOKEN_FILE="${TANGRAM_TOKEN_FILE:-$HOME/.config/tangram/token}"
# The verl.plugins entry point registers tangram_agent / tangram in every process where
# TANGRAM_ENABLED=1: this shell and a local Ray cluster inherit it; the runtime_env lines
# below carry it (and the service address) to the workers of a `ray start` cluster.
export TANGRAM_ENABLED=1
MODEL="${MODEL:-Qwen/Qwen2.5-Coder-7B-Instruct}"
TRAIN="${TRAIN:-$HOME/data/swe/train.parquet}"
VAL="${VAL:-$HOME/data/swe/test.parquet}"

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=grpo \
    data.train_files="$TRAIN" data.val_files="$VAL" \
    data.train_batch_size=64 data.max_prompt_length=4096 data.max_response_length=8192 \
    data.return_raw_chat=true \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=16 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.mode=async \
    actor_rollout_ref.rollout.n=8 \
    actor_rollout_ref.rollout.multi_turn.enable=true \
    actor_rollout_ref.rollout.multi_turn.format=hermes \
    actor_rollout_ref.rollout.multi_turn.max_assistant_turns=30 \
    actor_rollout_ref.rollout.multi_turn.max_tool_response_length=8000 \
    actor_rollout_ref.rollout.multi_turn.tool_config_path="$HERE/tool_config.yaml" \
    actor_rollout_ref.rollout.agent.agent_loop_config_path="$HERE/agent_loop.yaml" \
    actor_rollout_ref.rollout.agent.default_agent_loop=tangram_agent \
    +actor_rollout_ref.rollout.custom.tangram.enabled=true \
    +actor_rollout_ref.rollout.custom.tangram.url="$TANGRAM_URL" \
    +actor_rollout_ref.rollout.custom.tangram.token_file="$TANGRAM_TOKEN_FILE" \
    +actor_rollout_ref.rollout.custom.tangram.reward_cpu_max=8 \
    reward.reward_manager.name=tangram \
    "+ray_kwargs.ray_init.runtime_env.env_vars.TANGRAM_ENABLED=\"1\"" \
    "+ray_kwargs.ray_init.runtime_env.env_vars.TANGRAM_URL=\"$TANGRAM_URL\"" \
    "+ray_kwargs.ray_init.runtime_env.env_vars.TANGRAM_TOKEN_FILE=\"$TANGRAM_TOKEN_FILE\"" \
    trainer.n_gpus_per_node=8 trainer.nnodes=1 \
    trainer.project_name=tangram trainer.experiment_name=grpo-swe \
    "$@"
