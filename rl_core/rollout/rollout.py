"""Rank-0 rollout: one asyncio task per trajectory, envs from the pool, tokens from the router.

Each task leases an env for its whole episode and loops: send the current sequence's
`input_ids` to `/generate`, keep the engine's `output_ids` and logprobs as they are (never
re-tokenize decoded text), give the decoded action to the env, add its observation. The router
sends each request to whichever engine is free, so uneven response lengths don't leave engines
idle, and one progress bar on rank 0 shows the whole rollout.

`client` is anything with `async generate(input_ids, sampling_params, return_logprob=True, rid=None)`
returning SGLang's /generate answer (`workers.engines.client.EngineClient` in practice).
Env failures end their trajectory (counted, excluded); engine errors propagate, because a
broken engine or router is not something a retry at this level can fix. Reward functions
(`rl_core.rewards`) score the finished trajectories here, off the event loop, all of a rollout at
once (each group's under dynamic sampling, which filters on them), after the envs are returned;
a reward function that fails fails its trajectory like an env would, and counts towards
`env.max_failed_ratio`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping

from tqdm.auto import tqdm

from envs.base import Action, Observation
from envs.pool import EnvFailure, EnvLease, EnvPool
from rl_core.rewards import RewardFnError, RewardFunctions
from rl_core.rollout.first_turns import FirstTurnWave, Seat
from rl_core.rollout.metrics import check_reward_failures, rollout_metrics
from rl_core.rollout.trajectory import Trajectory, TrajectoryBuilder, image_pad_id, parse_generation
from workers.engines.client import max_input_length, max_output_length

logger = logging.getLogger(__name__)

KeepFn = Callable[[list[Trajectory]], bool]


@dataclass(frozen=True)
class RolloutSettings:
    """How a rollout generates; fixed for a job (evaluation swaps in its sampling with `with_sampling`).

    `sampling_params`: SGLang's, sent with every /generate. `max_turns`: actions per episode.
    `concurrency`: trajectories in flight at once (None: as many as envs allow).
    `max_total_tokens`: the model's context; a sequence never grows past what engines serve of it. `max_abort_retries`:
    how often one action continues after an `abort` (a weight push pausing the engines).
    `engine_timeout_s`: the longest one /generate may take.
    """

    sampling_params: Mapping[str, Any]
    max_turns: int = 1
    concurrency: int | None = None
    max_total_tokens: int | None = None
    max_abort_retries: int = 8
    progress: bool = True
    engine_timeout_s: float = 300.0

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {self.max_turns}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"rollout.concurrency must be >= 1 or null, got {self.concurrency}")
        object.__setattr__(self, "sampling_params", MappingProxyType(dict(self.sampling_params)))

    def with_sampling(self, sampling_params: Mapping[str, Any]) -> "RolloutSettings":
        return replace(self, sampling_params=sampling_params)

    def __reduce__(self):  # to the rollout process: a read-only mapping does not pickle, its dict does
        return type(self), tuple(dict(value) if isinstance(value, MappingProxyType) else value
                                 for value in (getattr(self, f.name) for f in fields(self)))


@dataclass(frozen=True)
class RolloutParts:
    """What a rollout talks to: the engines' `client` (the router's), the `env_pool`, the `tokenizer`,
    the `reward_fns` that score finished trajectories (None: the envs' rewards alone), and for prompts with
    images (a sample's `images`) the vision-language model's `processor`."""

    client: Any
    env_pool: EnvPool
    tokenizer: Any
    reward_fns: RewardFunctions | None = None
    processor: Any = None


@dataclass(frozen=True)
class GroupRule:
    """How `rollout_until` forms and filters groups: `size` trajectories of one sample; `keep(group)`
    decides whether a finished group is kept (None: all); at most `max_groups` launched (None: 10 per
    wanted group), after which it raises, or with `fill_with_dropped` tops the batch up with dropped groups."""

    size: int = 1
    keep: KeepFn | None = None
    max_groups: int | None = None
    fill_with_dropped: bool = False


@dataclass
class RolloutResult:
    trajectories: list[Trajectory]  # successful ones, in sample order (grouped for rollout_until)
    failed: list[Trajectory]  # env failures, left out of training
    metrics: dict[str, float] = field(default_factory=dict)


def first_observation(sample: dict) -> Observation:
    """The first state when the env's reset gives none: `prompt_ids` as they are, or `text`/`prompt` text."""
    for key in ("prompt_ids", "query_ids"):
        if sample.get(key) is not None:
            return [int(i) for i in sample[key]]
    for key in ("text", "prompt"):
        if isinstance(sample.get(key), str):
            return sample[key]
    raise KeyError(f"sample has no prompt: expected 'prompt_ids', 'text' or 'prompt' (or an env whose reset returns one), got keys {sorted(sample)}")


class _Rollout:
    """State of one rollout call: clients, limits, the progress bar and the sample printout."""

    def __init__(self, settings: RolloutSettings, parts: RolloutParts, policy_version: int | Callable[[], int]):
        self.client = parts.client
        self.env_pool = parts.env_pool
        self.tokenizer = tokenizer = parts.tokenizer
        self.sampling_params = dict(settings.sampling_params)
        self.max_turns = settings.max_turns
        # The version the engines serve now: a number, or a callable when pushes land mid-rollout (async).
        self.current_version = policy_version if callable(policy_version) else (lambda: policy_version)
        self.max_total_tokens = settings.max_total_tokens
        self.max_abort_retries = settings.max_abort_retries
        self.reward_fns = parts.reward_fns
        self.processor = parts.processor
        self.image_pad = None if parts.processor is None else image_pad_id(parts.processor, tokenizer)
        # Tokens that end a response (none under ignore_eos: OpenAI's fixed-length responses).
        self.stop_ids = set() if self.sampling_params.get("ignore_eos") else (
            set(self.sampling_params.get("stop_token_ids") or ()) | {getattr(tokenizer, "eos_token_id", None)})
        self.limit = asyncio.Semaphore(settings.concurrency) if settings.concurrency else None
        self.waves: list[FirstTurnWave] = []
        self.calls_alone = 0  # /generate calls sent outside a wave (later turns, retries after an abort)
        self.reward_s = 0.0  # time spent in reward functions (`scored`)
        self.sample_shown = False
        self.bar: tqdm | None = None

    def wave(self, members: int) -> FirstTurnWave:
        """The first turns of `members` trajectories launched now, sent together (`first_turns`)."""
        wave = FirstTurnWave(self.client, members)
        self.waves.append(wave)
        return wave

    def call_metrics(self, trajectories: int) -> dict[str, float]:
        """How the engines were asked: /generate calls, and the share of first turns sent in the first wave."""
        together = self.waves[0].sequences_sent if self.waves else 0
        return {"rollout/generate_calls": self.calls_alone + sum(w.calls_sent for w in self.waves),
                "rollout/first_wave_frac": together / trajectories if trajectories else 0.0,
                "rollout/reward_fn_s": self.reward_s}

    async def trajectory(self, sample: dict, seat: Seat, info: dict | None = None) -> Trajectory:
        """Run one episode; an env failure gives a failed (excluded) trajectory instead of raising."""
        if (self.limit is not None and self.limit.locked()) or not self.env_pool.has_free_env():
            seat.leave()  # it waits for another trajectory to end: its wave must not wait for it
        try:
            async with self.limit or contextlib.nullcontext():
                try:
                    async with self.env_pool.lease() as env:
                        traj = await self._episode(sample, env, seat)
                        traj.info["env_time_s"] = env.env_time_s
                except EnvFailure as err:
                    traj = Trajectory(sequences=[], sample=sample, failed=True, error=str(err))
        finally:
            seat.leave()  # ended before its first turn (e.g. a failed reset): its wave goes on without it
        traj.info.update(info or {})
        if not traj.failed and not self.sample_shown:
            self.sample_shown = True
            self._show(traj)
        return traj

    async def scored(self, trajectories: list[Trajectory]) -> list[Trajectory]:
        """The reward functions on every finished trajectory at once: a batched function is called once, any other
        once per completion. A trajectory whose function failed is replaced by a failed one, left out of training."""
        todo = [t for t in trajectories if not t.failed]
        if not self.reward_fns or not todo:
            return trajectories
        start = time.perf_counter()
        completions = self.tokenizer.batch_decode([t.final_response()[1] for t in todo], skip_special_tokens=True)
        results = await self.reward_fns.score_batch(completions, [t.sample for t in todo],
                                                    [t.info.get("conversation") for t in todo])  # envs/chat.py
        self.reward_s += time.perf_counter() - start
        failed: dict[int, Trajectory] = {}
        for traj, result in zip(todo, results):
            if isinstance(result, RewardFnError):
                logger.error("reward function failure, trajectory left out of training: %s", result)
                failed[id(traj)] = Trajectory(sequences=[], sample=traj.sample, failed=True, error=str(result),
                                              info={**traj.info, "reward_failed": True})
            else:
                traj.reward_components, traj.fn_reward = result, self.reward_fns.total(result)
        return [failed.get(id(t), t) for t in trajectories]

    async def _episode(self, sample: dict, env: EnvLease, seat: Seat) -> Trajectory:
        builder = TrajectoryBuilder(self.tokenizer, self.processor)
        first = await env.reset(sample)
        self._guard(env, "reset", functools.partial(builder.start, images=sample.get("images")),
                    first if first is not None else first_observation(sample))
        if self._room(len(builder.current)) < 1:  # e.g. a chat env's prompt with its tool list: nothing to train on
            env.reject("reset", f"returned a first state of {len(builder.current)} tokens, longer than the engines "
                                f"accept for a context of {self.max_total_tokens}; shorten the prompt (system prompt, "
                                "tool descriptions)")
        finish_reasons: list[str] = []
        env_info: dict = {}
        truncated = done = False
        for _ in range(self.max_turns):
            room = self._room(len(builder.current))
            if room < 1:  # context budget spent: stop before the engine would overflow
                builder.drop_trailing_context()
                finish_reasons.append("length")
                truncated = True
                break
            seed = sample.get("sampling_seed")  # reproducible sampling, e.g. across a resume
            action = await self._act(builder, room, None if seed is None else seed + 7919 * builder.num_turns, seat,
                                     env.next_sampling())
            builder.num_turns += 1
            if self.image_pad is not None and self.image_pad in action.token_ids:  # no image under it to train on
                env.reject("rollout", f"got an action with the image pad token ({self.image_pad}); left out of training")
            finish_reasons.append(action.finish_reason)
            result = await env.step(action)
            builder.add_reward(result.reward)
            env_info.update(result.info or {})
            if result.done or result.observation is None:  # no next state means the episode is over
                done = True
                break
            self._guard(env, "step", builder.add_observation, result.observation)
        return builder.build(sample, finish_reasons, {**env_info, "truncated": truncated, "done": done})

    @staticmethod
    def _guard(env: EnvLease, what: str, add: Callable, observation: Any) -> None:
        """An observation the builder cannot use is the env's failure, not the rollout's."""
        try:
            add(observation)
        except (TypeError, ValueError) as err:
            env.reject(what, f"returned an unusable observation: {err}")

    def _room(self, sequence_length: int) -> int:
        """How many tokens the engine may generate after a sequence this long (0: it may not be sent)."""
        if self.max_total_tokens is None:
            return 1 << 30
        if sequence_length > max_input_length(self.max_total_tokens):  # the engines refuse it (SGLang's reserve)
            return 0
        return max_output_length(self.max_total_tokens, sequence_length)

    async def _act(self, builder: TrajectoryBuilder, room: int, seed: int | None, seat: Seat,
                   env_sampling: Mapping[str, Any]) -> Action:
        """Generate one action; an `abort` (engine paused for a weight update) continues where it stopped.
        The trajectory's first request goes out with its wave (`seat`), every other one on its own.
        `env_sampling` (`Env.next_sampling`) may lower max_new_tokens and add stop_token_ids."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        wanted = min(int(self.sampling_params.get("max_new_tokens", 128)),
                     int(env_sampling.get("max_new_tokens") or room), room)
        sampling = dict(self.sampling_params)
        if env_sampling.get("stop_token_ids") and not sampling.get("ignore_eos"):
            sampling["stop_token_ids"] = sorted(set(sampling.get("stop_token_ids") or ()) |
                                                set(env_sampling["stop_token_ids"]))
        rid = uuid.uuid4().hex
        for attempt in range(self.max_abort_retries + 1):
            params = dict(sampling, max_new_tokens=wanted - len(ids))
            if seed is not None:
                params["sampling_seed"] = seed + attempt
            sent_version = self.current_version()
            if not seat.open:
                self.calls_alone += 1
            send = seat.generate if seat.open else functools.partial(self.client.generate, return_logprob=True)
            images = {"image_data": builder.current.image_data} if builder.current.image_data else {}  # VL only
            answer = await send(builder.current.engine_ids + ids, params, rid=f"{rid}-{attempt}", **images)
            gen = parse_generation(answer, sent_version)
            ids += gen.output_ids
            logprobs += gen.logprobs
            versions += gen.versions
            if gen.finish_reason != "abort" or len(ids) >= wanted or self._room(len(builder.current) + len(ids)) < 1:
                break
        if self.bar is not None:
            self.bar.set_postfix_str(f"{len(ids)} tok", refresh=False)
        text = builder.add_action(ids, logprobs, versions)
        reason = gen.finish_reason
        if reason == "length" and self._ends_with_stop(ids):  # SGLang checks the length limit before EOS
            reason = "stop"
        return Action(text=text, token_ids=ids, finish_reason=reason, logprobs=logprobs)

    def _ends_with_stop(self, ids: list[int]) -> bool:
        """The last token ended the response (EOS or a stop token) even though it also hit the limit."""
        return bool(ids) and ids[-1] in self.stop_ids

    def _show(self, traj: Trajectory) -> None:
        """Print the first finished trajectory, so a glance at the log shows what the policy writes."""
        seq = traj.sequences[0]
        first_action = seq.action_mask.index(1) if 1 in seq.action_mask else len(seq)
        query = self.tokenizer.decode(seq.input_ids[:first_action], skip_special_tokens=True)
        response = self.tokenizer.decode(seq.input_ids[first_action:], skip_special_tokens=True)
        more = f" (+{len(traj.sequences) - 1} more sequences)" if len(traj.sequences) > 1 else ""
        message = (f"[sample] query: {query!r}\n[sample] response{more}: {response!r}\n"
                   f"[sample] env_reward={traj.env_reward:.3f} turns={traj.num_turns} finish={traj.finish_reasons}")
        if self.bar is not None and not self.bar.disable:
            tqdm.write(message)
        else:
            logger.info(message)


async def _gather_all(coroutines: Iterable[Awaitable]) -> list:
    """Like asyncio.gather, but a crash in one task cancels the others instead of leaving them running."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def rollout(samples: list[dict], settings: RolloutSettings, parts: RolloutParts,
                  policy_version: int | Callable[[], int]) -> RolloutResult:
    """Run one trajectory per sample, all concurrently (envs and `concurrency` permitting).

    Raises `envs.pool.TooManyEnvFailures` when this rollout's env (and reward function) failure
    ratio exceeds the pool's `max_failed_ratio`.
    """
    run, env_pool = _Rollout(settings, parts, policy_version), parts.env_pool
    before = env_pool.counts()
    start = time.perf_counter()
    with tqdm(total=len(samples), desc=f"rollout v{run.current_version()}", unit="traj", disable=not settings.progress,
              dynamic_ncols=True) as bar:
        run.bar = bar
        wave = run.wave(len(samples))

        async def one(sample: dict) -> Trajectory:
            traj = await run.trajectory(sample, wave.seat())
            bar.update(1)
            return traj

        results = await run.scored(await _gather_all(one(sample) for sample in samples))
    env_pool.check_failure_ratio(since=before)
    check_reward_failures(results, env_pool.max_failed_ratio)
    kept = [t for t in results if not t.failed]
    failed = [t for t in results if t.failed]
    metrics = rollout_metrics(kept, failed, time.perf_counter() - start, env_pool)
    return RolloutResult(kept, failed, {**metrics, **run.call_metrics(len(samples))})


async def rollout_until(n_wanted: int, sample_iter: Iterable[dict | list[dict]], settings: RolloutSettings,
                        parts: RolloutParts, policy_version: int | Callable[[], int],
                        rule: GroupRule = GroupRule()) -> RolloutResult:
    """Keep launching groups until `n_wanted` GROUPS are kept; returns their trajectories, group by group.

    A group is `rule.size` trajectories of the same sample (or, when `sample_iter` yields lists,
    one trajectory per sample of the list), generated together (for group baselines).
    `rule.keep(group)` decides whether a finished group is kept (e.g. drop groups whose rewards have
    zero variance); a group with any failed trajectory is dropped. New groups are launched only
    to replace dropped ones, so nothing is generated and then wasted. Stops with a warning if
    `sample_iter` runs out. When `rule.max_groups` (default 10 * n_wanted) are launched without
    enough kept, it raises, or with `rule.fill_with_dropped` tops the batch up with groups `keep`
    dropped (counted in `rollout/groups_filled`), so a step always trains on a full batch.
    """
    if n_wanted < 1 or rule.size < 1:
        raise ValueError(f"rollout_until needs n_wanted >= 1 and a group size >= 1, got {n_wanted} and {rule.size}")
    group_size, keep_fn = rule.size, rule.keep
    max_groups = rule.max_groups if rule.max_groups is not None else 10 * n_wanted
    run, env_pool = _Rollout(settings, parts, policy_version), parts.env_pool
    samples: Iterator[dict] = iter(sample_iter)
    before = env_pool.counts()
    start = time.perf_counter()
    kept: list[list[Trajectory]] = []
    rejected: list[list[Trajectory]] = []  # finished groups keep_fn dropped (fill_with_dropped tops up from them)
    failed: list[Trajectory] = []
    in_flight: set[asyncio.Future] = set()
    launched = dropped = 0
    exhausted = False

    def members_of(sample: dict | list[dict]) -> list[dict]:
        return sample if isinstance(sample, list) else [sample] * group_size

    async def group(members: list[dict], index: int, wave: FirstTurnWave) -> list[Trajectory]:
        return await run.scored(await _gather_all(run.trajectory(member, wave.seat(), {"group": index})
                                                  for member in members))

    with tqdm(total=n_wanted, desc=f"rollout v{run.current_version()}", unit="group", disable=not settings.progress,
              dynamic_ncols=True) as bar:
        run.bar = bar
        try:
            while len(kept) < n_wanted:
                launching = []  # the groups launched now, whose first turns go out together
                while not exhausted and len(kept) + len(in_flight) + len(launching) < n_wanted and launched < max_groups:
                    sample = next(samples, None)
                    if sample is None:
                        exhausted = True
                        break
                    launching.append((members_of(sample), launched))
                    launched += 1
                if launching:
                    wave = run.wave(sum(len(members) for members, _ in launching))
                    in_flight.update(asyncio.ensure_future(group(members, index, wave)) for members, index in launching)
                if not in_flight:
                    break
                done, in_flight = await asyncio.wait(in_flight, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    members = task.result()
                    failed += [t for t in members if t.failed]
                    if any(t.failed for t in members) or (keep_fn is not None and not keep_fn(members)):
                        dropped += 1
                        if not any(t.failed for t in members):
                            rejected.append(members)
                        continue
                    kept.append(members)
                    bar.update(1)
                bar.set_postfix(launched=launched, dropped=dropped, refresh=False)
        finally:
            for task in in_flight:
                task.cancel()
            await asyncio.gather(*in_flight, return_exceptions=True)
    env_pool.check_failure_ratio(since=before)
    check_reward_failures([t for g in kept + rejected for t in g] + failed, env_pool.max_failed_ratio)
    filled = 0
    if len(kept) < n_wanted and not exhausted and rule.fill_with_dropped:
        filled = min(n_wanted - len(kept), len(rejected))
        kept += rejected[:filled]
    if len(kept) < n_wanted and not exhausted:
        raise RuntimeError(
            f"rollout_until kept {len(kept)} of {n_wanted} groups after launching {launched} "
            f"(max_groups={max_groups}): keep_fn dropped {dropped}. Relax the filter or raise max_groups.")
    if exhausted and len(kept) < n_wanted:
        logger.warning("sample iterator ran out: kept %d of %d wanted groups", len(kept), n_wanted)
    trajectories = [t for members in kept for t in members]
    metrics = rollout_metrics(trajectories, failed, time.perf_counter() - start, env_pool)
    metrics.update(run.call_metrics(sum(len(members) for members in kept + rejected) + len(failed)))
    metrics.update({"rollout/groups_launched": launched, "rollout/groups_kept": len(kept),
                    "rollout/groups_dropped": dropped, "rollout/groups_filled": filled,
                    "rollout/samples_exhausted": float(exhausted)})
    return RolloutResult(trajectories, failed, metrics)
