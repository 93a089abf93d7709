"""The PPO config's cross-field rules, checked before anything loads (`validate`), and the ones that need the
models' configs (`check_models`): each broken rule is one line naming the keys and the fix."""

from __future__ import annotations

import importlib.util

from rl_core.config import require, validate_profile_steps
from rl_core.ppo.config import PPOConfig, max_sequence_length
from workers.engines.client import OUTPUT_RESERVE, max_input_length
from workers.layout import packs_into_one_row


def validate(cfg: PPOConfig) -> None:
    """Cross-field rules: everything that would otherwise fail minutes into a run."""
    algo, ro, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
    trainer.validate()
    cfg.model.lora.validate()
    cfg.model.validate(algo.packing)
    require(cfg.model.lora.dropout == 0.0, f"config key 'model.lora.dropout' must be 0 in the PPO job, got "
            f"{cfg.model.lora.dropout} (OpenAI detail: no dropout; old logprobs and the weight probe must be exact)")
    require(algo.batch_size > 0, f"config key 'algorithm.batch_size' must be > 0, got {algo.batch_size}")
    require(algo.nminibatches > 0 and algo.batch_size % algo.nminibatches == 0,
            f"algorithm.batch_size={algo.batch_size} is not divisible into algorithm.nminibatches="
            f"{algo.nminibatches} minibatches; pick a batch_size that is a multiple of nminibatches")
    require(algo.group_size >= 1 and algo.batch_size % algo.group_size == 0,
            f"algorithm.batch_size={algo.batch_size} is not a multiple of algorithm.group_size={algo.group_size}")
    require(algo.advantage_estimator == "gae" or algo.group_size >= 2,
            f"algorithm.advantage_estimator={algo.advantage_estimator} needs algorithm.group_size >= 2 "
            "(several responses per prompt to form a baseline)")
    require(algo.noptepochs >= 1, f"config key 'algorithm.noptepochs' must be >= 1, got {algo.noptepochs}")
    require(algo.max_tokens_per_device > 0, "config key 'algorithm.max_tokens_per_device' must be > 0")
    require(algo.packing or not algo.share_prompts,
            "algorithm.share_prompts=true packs a group's prompt once, so it needs algorithm.packing=true; set both")
    require(not (algo.share_prompts and packs_into_one_row(cfg.model.attn_implementation)),
            f"algorithm.share_prompts=true lets a group's responses read one copy of its prompt, which "
            f"model.attn_implementation={cfg.model.attn_implementation}'s varlen kernel cannot; set "
            "algorithm.share_prompts=false (packing still drops all padding)")
    require(0.0 <= algo.gamma <= 1.0 and 0.0 <= algo.lam <= 1.0, "algorithm.gamma and algorithm.lam must be in [0, 1]")
    algo.validate("algorithm")  # the optimizer keys, as every job checks them
    require(algo.critic_lr is None or algo.critic_lr > 0,
            f"config key 'algorithm.critic_lr' must be > 0 or null (= algorithm.lr), got {algo.critic_lr}")
    require(algo.kl.horizon > 0, "config key 'algorithm.kl.horizon' must be > 0")
    require(algo.old_logprobs_max_gap is None or algo.old_logprobs_max_gap >= 0,
            "config key 'algorithm.old_logprobs_max_gap' must be >= 0 (or null: by the precision in use)")
    rc = algo.rollout_correction
    require(rc.is_cap >= 1.0, "config key 'algorithm.rollout_correction.is_cap' must be >= 1")
    require(0.0 < rc.mask_low <= 1.0 <= rc.mask_high,
            "algorithm.rollout_correction needs 0 < mask_low <= 1 <= mask_high (a band around ratio 1)")
    require(ro.response_length > 0, "config key 'rollout.response_length' must be > 0")
    require(ro.temperature > 0, "config key 'rollout.temperature' must be > 0 (logprobs divide logits by it)")
    require(0.0 < ro.top_p <= 1.0, f"config key 'rollout.top_p' must be in (0, 1], got {ro.top_p}")
    require(ro.max_turns >= 1, "config key 'rollout.max_turns' must be >= 1")
    require(0.0 < ro.mem_fraction_static < 1.0,
            f"rollout.mem_fraction_static={ro.mem_fraction_static} cannot fit colocated with training; use (0, 1)")
    require(ro.tp_size >= 1, "config key 'rollout.tp_size' must be >= 1")
    require(ro.kv_tokens is None or ro.kv_tokens > 0, "config key 'rollout.kv_tokens' must be > 0 or null (planned)")
    require(ro.kv_tokens is None or "max_total_tokens" not in ro.sglang_args,
            "rollout.kv_tokens and rollout.sglang_args.max_total_tokens both set the engine's KV pool; keep one")
    require(ro.node_timeout_s >= 3, f"config key 'rollout.node_timeout_s' must be >= 3 (seconds), got {ro.node_timeout_s}")
    require(ro.device_memory_gb is None or ro.device_memory_gb > 0,
            "config key 'rollout.device_memory_gb' must be > 0 or null (detected)")
    require(ro.weight_bucket_mb >= 1, "config key 'rollout.weight_bucket_mb' must be >= 1")
    require(ro.weight_check_tolerance is None or ro.weight_check_tolerance > 0,
            "config key 'rollout.weight_check_tolerance' must be > 0 or null (by engine dtype)")
    require(ro.sglang_python is None or ro.engine == "sglang",
            "rollout.sglang_python is set but rollout.engine is not sglang; drop it or set rollout.engine=sglang")
    require(not ro.sglang_args or ro.engine == "sglang",
            "rollout.sglang_args is set but rollout.engine is not sglang; drop it or set rollout.engine=sglang")
    require(cfg.data.max_prompt_length > 0, "config key 'data.max_prompt_length' must be > 0")
    require(cfg.data.on_long_prompt == "truncate" or (cfg.data.start_text is None and cfg.data.end_text is None),
            "data.start_text/end_text belong to OpenAI's query mode; set data.on_long_prompt=truncate or drop them")
    validate_rewards(cfg)
    validate_distill(cfg)
    validate_group_options(cfg)
    validate_eval(cfg)
    require(cfg.env.num_envs >= 1, "config key 'env.num_envs' must be >= 1")
    require(0.0 <= cfg.env.max_failed_ratio <= 1.0, "config key 'env.max_failed_ratio' must be in [0, 1]")
    require(cfg.env.step_timeout_s > 0, "config key 'env.step_timeout_s' must be > 0")
    require(cfg.env.tool_timeout_s > 0, "config key 'env.tool_timeout_s' must be > 0")
    require(cfg.env.tool_concurrency >= 1, "config key 'env.tool_concurrency' must be >= 1")
    from envs.mcp_tools import entry_problem
    from envs.tool_parsers import PARSERS, REASONING_PARSERS

    for index, entry in enumerate(cfg.env.tools):
        problem = entry_problem(entry)
        require(problem is None, f"config key 'env.tools[{index}]' {problem}")
    require(not any(isinstance(entry, dict) for entry in cfg.env.tools) or importlib.util.find_spec("mcp"),
            "env.tools lists an MCP server but the mcp package is not installed; pip install -e '.[mcp]'")

    parsers = [*PARSERS, "auto"]
    require(cfg.env.tool_parser in parsers or ":" in cfg.env.tool_parser,
            f"config key 'env.tool_parser' is {cfg.env.tool_parser!r}; use one of {parsers} or 'pkg.module:function'")
    require(cfg.env.reasoning_parser in REASONING_PARSERS,
            f"config key 'env.reasoning_parser' is {cfg.env.reasoning_parser!r}; use one of {list(REASONING_PARSERS)}")
    require(cfg.env.max_result_tokens is None or cfg.env.max_result_tokens >= 1,
            "config key 'env.max_result_tokens' must be >= 1 or null")
    require(not cfg.env.tools or cfg.env.tool_timeout_s < cfg.env.step_timeout_s,
            f"config key 'env.tool_timeout_s' ({cfg.env.tool_timeout_s:g}) must be below env.step_timeout_s "
            f"({cfg.env.step_timeout_s:g}): a step runs its tool calls")
    require(trainer.total_episodes >= algo.batch_size,
            f"trainer.total_episodes={trainer.total_episodes} is smaller than one batch "
            f"(algorithm.batch_size={algo.batch_size})")
    validate_profile_steps(trainer.profile_steps, trainer.total_episodes // algo.batch_size,
                           f"trainer.total_episodes={trainer.total_episodes} / algorithm.batch_size={algo.batch_size}")
    require(cfg.async_.max_staleness >= 0, "config key 'async.max_staleness' must be >= 0")
    require(cfg.async_.queue_batches >= 1, "config key 'async.queue_batches' must be >= 1")
    in_flight = cfg.async_.batches_in_flight
    require(in_flight >= 1, "config key 'async.batches_in_flight' must be >= 1")
    if trainer.mode == "async" and in_flight > 1:  # else the second batch waits for the first's envs: no overlap
        room = min(cfg.env.num_envs, cfg.rollout.concurrency)
        require(room >= in_flight * algo.batch_size,
                f"async.batches_in_flight={in_flight} generates {in_flight} x algorithm.batch_size="
                f"{algo.batch_size} trajectories at once, but env.num_envs={cfg.env.num_envs} and rollout.concurrency="
                f"{cfg.rollout.concurrency} allow {room}: raise both to {in_flight * algo.batch_size}")
    require(cfg.reward.truncate_after >= 0, "config key 'reward.truncate_after' must be >= 0")
    longest = max_sequence_length(cfg)
    require(longest <= algo.max_tokens_per_device,
            f"one sequence can reach {longest} tokens (data.max_prompt_length + rollout.response_length * "
            f"rollout.max_turns) but algorithm.max_tokens_per_device={algo.max_tokens_per_device}; raise it")


def check_context_length(cfg: PPOConfig, model_max_positions: int | None, which: str | None = None,
                         served: bool = True) -> None:
    """The model `which` names (default: the policy, "model.path=...") must hold the longest query+response;
    `served`: as the engines serve its context (SGLang keeps a few positions: workers/engines/client.py)."""
    if model_max_positions is None:
        return
    longest = max_sequence_length(cfg)
    response = "eval.response_length" if (cfg.eval.response_length or 0) > cfg.rollout.response_length \
        else "rollout.response_length"  # the longer of the two bounds a sequence
    limit = model_max_positions - OUTPUT_RESERVE if served else model_max_positions
    model = which or f"model.path={cfg.model.path}"
    held = f"the {limit} tokens the engines serve of the model's context of {model_max_positions}" if served \
        else f"the model's context of {model_max_positions}"
    require(longest <= limit,
            f"data.max_prompt_length + {response} * rollout.max_turns = {longest} tokens exceeds {held} ({model}); "
            f"shorten data.max_prompt_length or {response}")
    require(not served or cfg.data.max_prompt_length <= max_input_length(model_max_positions),
            f"data.max_prompt_length={cfg.data.max_prompt_length} exceeds the longest input the engines accept "
            f"for the model's context of {model_max_positions} ({max_input_length(model_max_positions)}, {model}); "
            "shorten data.max_prompt_length")


def check_models(cfg: PPOConfig) -> None:
    """The rules that need the models' configs (read at parse time, before any process group or engine
    starts): the policy, which the engines serve, and the reward model, which reads query+response,
    must each hold the longest sequence."""
    from transformers import AutoConfig

    from workers.loading import context_length, model_context_length

    policy = AutoConfig.from_pretrained(cfg.model.path)
    check_context_length(cfg, context_length(policy))
    if cfg.rollout.engine == "sglang":
        check_sglang_serves_the_window(cfg, policy)
    if cfg.reward.model_path:
        check_context_length(cfg, model_context_length(cfg.reward.model_path),
                             f"reward.model_path={cfg.reward.model_path}", served=False)
    if cfg.distill.teacher_path:
        check_context_length(cfg, model_context_length(cfg.distill.teacher_path),
                             f"distill.teacher_path={cfg.distill.teacher_path}", served=False)


def check_sglang_serves_the_window(cfg: PPOConfig, policy) -> None:
    """SGLang 0.5.23 runs Mistral as Llama, with full attention: past a Mistral's sliding window its
    logprobs and samples are not the trainer's model's. The weight probe (21 tokens) is too short to see
    a real model's window, so the mismatch is refused here rather than trained on."""
    window = getattr(policy, "sliding_window", None)
    longest = max_sequence_length(cfg)
    require(policy.model_type != "mistral" or window is None or window >= longest,
            f"model.path={cfg.model.path} is a Mistral with sliding_window={window}, which SGLang serves without "
            f"its window (full attention), but sequences reach {longest} tokens; keep data.max_prompt_length + "
            f"rollout.response_length within {window}, or use rollout.engine=embedded")


REWARD_FN_KEYS = ("fn", "weight", "kwargs")


def validate_rewards(cfg: PPOConfig) -> None:
    """reward.fns entries: {fn: import path, weight: number, kwargs: mapping}; at least one reward source."""
    reward = cfg.reward
    for name, spec in reward.fns.items():
        key = f"reward.fns.{name}"
        require(isinstance(spec, dict) and isinstance(spec.get("fn"), str) and ":" in spec["fn"],
                f"config key '{key}' must be a mapping with fn: 'pkg.module:function' (and optional weight, kwargs)")
        unknown = sorted(set(spec) - set(REWARD_FN_KEYS))
        require(not unknown, f"unknown config key '{key}.{unknown[0] if unknown else ''}'; valid keys: fn, weight, kwargs")
        require(isinstance(spec.get("weight", 1.0), (int, float)) and not isinstance(spec.get("weight", 1.0), bool),
                f"config key '{key}.weight' must be a number, got {spec.get('weight')!r}")
        require(isinstance(spec.get("kwargs", {}), dict), f"config key '{key}.kwargs' must be a mapping")
    require(reward.fn_timeout_s > 0, "config key 'reward.fn_timeout_s' must be > 0")
    require(reward.fn_processes >= 0, "config key 'reward.fn_processes' must be >= 0 (0 = a thread pool)")


def validate_distill(cfg: PPOConfig) -> None:
    """On-policy distillation: one teacher, a positive weight on its term, a reward weight of 0 or more."""
    distill = cfg.distill
    require(distill.teacher_path is None or distill.teacher_url is None,
            "distill.teacher_path and distill.teacher_url both name a teacher; keep one (a local teacher, or a "
            "server for one too big to sit beside the trainer)")
    require(distill.coef > 0, f"config key 'distill.coef' must be > 0, got {distill.coef}")
    require(distill.reward_coef >= 0, f"config key 'distill.reward_coef' must be >= 0 (0 = pure distillation), "
            f"got {distill.reward_coef}")
    require(distill.teacher_timeout_s > 0, "config key 'distill.teacher_timeout_s' must be > 0")


def validate_group_options(cfg: PPOConfig) -> None:
    """Rules of the GRPO-family options (clip ranges, GSPO, DAPO sampling and shaping)."""
    algo, ro = cfg.algorithm, cfg.rollout
    for key in ("cliprange", "cliprange_low", "cliprange_high"):
        value = getattr(algo, key)
        require(value is None or value >= 0, f"config key 'algorithm.{key}' must be >= 0, got {value}")
    require(algo.cliprange_low is None or algo.cliprange_low < 1,
            "config key 'algorithm.cliprange_low' must be < 1 (the ratio floor 1 - cliprange_low stays positive)")
    require(algo.turn_advantage == "trajectory" or algo.advantage_estimator != "gae",
            "algorithm.turn_advantage=discounted needs a group estimator: set algorithm.advantage_estimator to grpo, "
            "rloo or reinforce (GAE discounts per token with algorithm.gamma)")
    require(0 < algo.turn_gamma <= 1, f"config key 'algorithm.turn_gamma' must be in (0, 1], got {algo.turn_gamma}")
    require(0 <= algo.overlong_buffer <= ro.response_length,
            f"algorithm.overlong_buffer={algo.overlong_buffer} must be in [0, rollout.response_length={ro.response_length}]")
    if algo.filter_zero_variance_groups:
        require(algo.advantage_estimator != "gae",
                "algorithm.filter_zero_variance_groups needs a group estimator (grpo, rloo, reinforce)")
        require(cfg.trainer.mode == "sync", "algorithm.filter_zero_variance_groups works in trainer.mode=sync only")
        require(not cfg.reward.model_path,
                "algorithm.filter_zero_variance_groups needs rewards known at rollout time (reward.fns or the env); "
                "set reward.model_path=null")
        require(algo.filter_max_groups_factor >= 1, "config key 'algorithm.filter_max_groups_factor' must be >= 1")


def validate_eval(cfg: PPOConfig) -> None:
    ev = cfg.eval
    require(ev.n >= 1, f"config key 'eval.n' must be >= 1, got {ev.n}")
    require(ev.temperature >= 0, "config key 'eval.temperature' must be >= 0 (0 = greedy)")
    require(0.0 < ev.top_p <= 1.0, f"config key 'eval.top_p' must be in (0, 1], got {ev.top_p}")
    require(ev.response_length is None or ev.response_length > 0, "config key 'eval.response_length' must be > 0")
    require(ev.max_prompts is None or ev.max_prompts > 0, "config key 'eval.max_prompts' must be > 0 or null")
    require(cfg.eval.every >= 0, "config key 'eval.every' must be >= 0")
    require(cfg.eval.every == 0 or cfg.data.eval_path is not None,
            "eval.every is set but data.eval_path is null; give held-out prompts in data.eval_path")
    require(ev.accuracy_fn is None or ev.accuracy_fn in cfg.reward.fns,
            f"eval.accuracy_fn={ev.accuracy_fn!r} is not one of reward.fns ({', '.join(cfg.reward.fns) or 'none'})")
