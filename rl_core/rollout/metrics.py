"""A rollout's numbers for the logger, and the failure rule shared by every rollout."""

from __future__ import annotations

from collections import Counter

from envs.pool import EnvPool, TooManyEnvFailures
from rl_core.rollout.trajectory import Trajectory


def check_reward_failures(results: list[Trajectory], max_failed_ratio: float) -> None:
    """Env and reward-function failures together may not exceed `max_failed_ratio` of a rollout."""
    reward_failed = sum(1 for t in results if t.info.get("reward_failed"))
    failed = sum(1 for t in results if t.failed)
    if reward_failed and failed / len(results) > max_failed_ratio:
        raise TooManyEnvFailures(
            f"{failed} of {len(results)} trajectories failed ({reward_failed} in a reward function; "
            f"{failed / len(results):.0%} > env.max_failed_ratio={max_failed_ratio:.0%}); the errors are in "
            "the log above. Fix the reward function, raise reward.fn_timeout_s if it is slow, or raise "
            "env.max_failed_ratio to tolerate more failures.")


def rollout_metrics(kept: list[Trajectory], failed: list[Trajectory], wall_s: float,
                    env_pool: EnvPool | None = None) -> dict[str, float]:
    """Per-rollout numbers for the logger: throughput, lengths, finish reasons, env time, failures."""
    lengths = [t.num_action_tokens for t in kept]
    generated = sum(lengths)
    metrics: dict[str, float] = {
        "rollout/trajectories": len(kept),
        "rollout/failed": len(failed),
        "rollout/wall_s": wall_s,
        "rollout/tokens_per_s": generated / wall_s if wall_s > 0 else 0.0,
        "rollout/generated_tokens": generated,
        "rollout/response_length_mean": generated / len(lengths) if lengths else 0.0,
        "rollout/response_length_min": min(lengths, default=0),
        "rollout/response_length_max": max(lengths, default=0),
        "rollout/turns_mean": sum(t.num_turns for t in kept) / len(kept) if kept else 0.0,
        "rollout/sequences_per_trajectory": sum(len(t.sequences) for t in kept) / len(kept) if kept else 0.0,
        "rollout/env_reward_mean": sum(t.env_reward for t in kept) / len(kept) if kept else 0.0,
        "rollout/env_time_s": sum(t.info.get("env_time_s", 0.0) for t in kept),
        # Cut by the length limit, not ended by EOS / a stop token / the env (all of them under ignore_eos).
        "rollout/truncated_frac": sum(t.truncated for t in kept) / len(kept) if kept else 0.0,
    }
    metrics["reward/fn_failed"] = sum(1 for t in failed if t.info.get("reward_failed"))
    names = sorted({name for t in kept for name in t.reward_components})
    for name in names:  # every reward function on its own
        metrics[f"reward/fn/{name}"] = sum(t.reward_components.get(name, 0.0) for t in kept) / len(kept)
    if names:
        metrics["reward/fn_total_mean"] = sum(t.fn_reward for t in kept) / len(kept)
    for reason, count in sorted(Counter(r for t in kept for r in t.finish_reasons).items()):
        metrics[f"rollout/finish_reason/{reason}"] = count
    if env_pool is not None:
        metrics["rollout/envs_max_in_use"] = env_pool.max_in_use
    chats = [t for t in kept if "template_divergences" in t.info]  # conversation envs (envs/chat.py)
    if chats:
        def mean(key: str) -> float:
            return sum(t.info.get(key, 0) for t in chats) / len(chats)

        metrics["rollout/tool_calls_mean"] = mean("tool_calls")
        metrics["rollout/tool_errors_mean"] = mean("tool_errors")
        metrics["rollout/tool_time_s_mean"] = mean("tool_time_s")
        metrics["rollout/template_divergences"] = sum(t.info["template_divergences"] for t in chats)
        # What a divergence costs: the tokens of the new sequences, sent to the engine again.
        metrics["rollout/reprefill_tokens"] = sum(t.info.get("reprefill_tokens", 0) for t in chats)
        for kind in sorted({k for t in chats for k in t.info if k.startswith("tool_errors/")}):
            metrics[f"rollout/{kind}"] = sum(t.info.get(kind, 0) for t in chats)
    for key in sorted({k for t in kept for k in t.info if k.startswith("agent/")}):  # an agent's own metrics
        metrics[f"rollout/{key}"] = sum(t.info.get(key, 0.0) for t in kept) / len(kept)
    return metrics
