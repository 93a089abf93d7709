"""The metrics of the PPO job and the GRPO family, by group, in the order docs/metrics.md lists them."""

from __future__ import annotations

from rl_core.metric_docs.schema import Group, Metric as M

PPO_GROUPS: tuple[Group, ...] = (
    Group("The row", "What places the row in the run.", (
        M("step", "step", "The step the row belongs to, 1 to the run's last. Step 0 holds the evaluation before "
          "any training (with `data.eval_path`).", "One row per step; a resumed run continues the numbers."),
        M("episodes", "episodes", "Episodes trained on so far: step x `algorithm.batch_size`.",
          "Grows by the batch size each step."),
        M("data/prompts_skipped", "prompts", "Training prompts skipped so far as they were drawn: longer than "
          "`data.max_prompt_length` (`data.on_long_prompt=skip`), or without the OpenAI start/end text. A running "
          "total, a prompt counted again in each epoch. Malformed rows (`data.on_malformed=skip`) are dropped "
          "at load and printed instead.",
          "0, or a small share of the dataset; a large one means the length limit cuts much of the data."),
    )),
    Group("Policy", "The actor's update (`train_minibatch` and `policy_loss` in `rl_core/ppo/step.py`; the maths in "
          "[Algorithms](algorithms.md#policy-loss)).", (
        M("policy/loss", "loss", "The actor's loss per optimizer step: the clipped surrogate, minus "
          "`algorithm.entropy_coef` x entropy, plus `kl/coef` x the KL when `algorithm.kl.placement=loss`, "
          "aggregated by `algorithm.loss_agg`.",
          "Near 0 and noisy: the advantages average to about 0 over a batch. Not a measure of progress."),
        M("policy/clipfrac", "fraction", "Share of generated tokens whose clipped term is the larger one "
          "(the ratio left the clip range in the direction the advantage pushes it).",
          "0 with one epoch and one minibatch (the only optimizer step has ratio 1). With more, small and "
          "growing over the epochs; most tokens clipped means each update moves far past the clip range: lower "
          "`algorithm.lr` or `algorithm.noptepochs`."),
        M("policy/approx_kl", "nats per token", "0.5 x mean squared log ratio between the policy being trained "
          "and pi_old over generated tokens (the k2 estimate of their KL; with `importance_ratio=sequence`, of "
          "the sequence ratio).", "0 with a single optimizer step per batch, small otherwise; a sudden rise "
          "goes with a rising `policy/clipfrac`."),
        M("policy/entropy", "nats per token", "Mean entropy of the policy's next-token distribution at the "
          "sampling temperature, over generated tokens.",
          "Falls slowly as the policy sharpens; a collapse towards 0 early in a run means it stopped exploring."),
        M("policy/kl_loss", "nats per token", "Mean per-token KL from the policy to the reference "
          "(`algorithm.kl.estimator`), the term added to the loss. Logged with `algorithm.kl.placement=loss` only.",
          "Starts at 0 and grows slowly; the coefficient (`kl/coef`) holds it down."),
        M("policy/grad_norm", "L2 norm", "The actor's global gradient norm before clipping "
          "(`algorithm.max_grad_norm`). A non-finite norm skips that update.",
          "Finite and without lasting jumps; 0 when every advantage of the batch is 0 (every GRPO group "
          "scored the same)."),
        M("policy/lr", "learning rate", "The actor's learning rate after the step's optimizer steps (with "
          "`algorithm.anneal_lr`, the schedule's next value).",
          "`algorithm.lr`, falling linearly to 0 over the run when annealed."),
        M("policy/optimizer_steps", "steps", "Optimizer steps this step took: `noptepochs` x `nminibatches`.",
          "Constant."),
    )),
    Group("Value function", "The critic, with `algorithm.advantage_estimator=gae` only.", (
        M("value/loss", "squared reward units", "Mean over generated tokens of 0.5 x max((v - R)^2, "
          "(v_clipped - R)^2), before the `algorithm.vf_coef` weight.",
          "Falls over the first steps as the critic learns the returns, then stays low."),
        M("value/vf_clipfrac", "fraction", "Share of generated tokens where the clipped value loss is the larger "
          "(the new value moved more than `algorithm.cliprange_value` from the old).",
          "Small; near 1 means the returns move faster than the clip range lets the critic follow."),
        M("value/grad_norm", "L2 norm", "The critic's global gradient norm before clipping.",
          "Finite and without lasting jumps."),
    )),
    Group("KL to the reference", "The KL between pi_old and the frozen reference policy (`compute_advantages` "
          "in `rl_core/ppo/step.py`). Without a reference model (`algorithm.kl.init_coef=0` and "
          "`algorithm.kl.adaptive=false`) both are 0.", (
        M("kl/mean", "nats per response", "KL(pi_old || reference) by `algorithm.kl.estimator`, summed over each "
          "trajectory's generated tokens, averaged over the batch. Also logged when the KL goes in the loss.",
          "Grows from 0 as the policy leaves the reference; with the adaptive controller it settles near "
          "`algorithm.kl.target`."),
        M("kl/coef", "coefficient", "The KL coefficient this step used; the adaptive controller updates it after "
          "the step.", "Constant when `algorithm.kl.adaptive=false`; otherwise it rises while `kl/mean` is above "
          "the target and falls while below, by at most 20% x batch size / horizon per step."),
    )),
    Group("On-policy distillation", "The teacher's per-token signal (`distill.*`; `distill_advantages` in "
          "`rl_core/ppo/distill.py`), logged when a teacher is set.", (
        M("distill/reverse_kl", "nats per token", "Mean over the batch's sampled tokens of log pi_student - "
          "log pi_teacher (pi_old's logprob against the teacher's, temperature 1): the one-sample estimate of "
          "KL(student || teacher) that each token's advantage subtracts, times `distill.coef`.",
          "Falls towards 0 as the student takes up the teacher's choices; a rise means the student leaves it."),
        M("distill/teacher_logprob", "nats per token", "Mean teacher logprob of the tokens the student sampled.",
          "Rises towards the teacher's own confidence on its answers (near 0 for a sure teacher)."),
    )),
    Group("Rewards", "What the batch scored (`score_metrics` and `compute_advantages` in `rl_core/ppo/step.py`, "
          "`trajectory_scores` in `rl_core/ppo/scoring.py`; reward functions in `rl_core/rollout/metrics.py`).", (
        M("reward/score_mean", "reward units", "Mean reward-model score of the batch, before the rejection "
          "penalty; 0 without a reward model.", "Rises over training."),
        M("reward/score_std", "reward units", "Standard deviation of the reward-model scores over the batch.",
          "Above 0: identical scores give nothing to learn from."),
        M("reward/rejected_frac", "fraction", "Share of responses with no `reward.truncate_token` at or after "
          "`reward.truncate_after`, which get `reward.penalty` instead of their score.",
          "Falls as the policy learns to end its sentences (sentiment recipe); 0 without a reward model."),
        M("reward/env_mean", "reward units", "Mean environment reward per trajectory (the sum of its env step "
          "rewards).", "Rises over training for envs that reward the task; 0 for envs that give none."),
        M("reward/total_mean", "reward units", "Mean total reward per trajectory that the advantages come from: "
          "score (penalties and shaping included) + reward functions + env rewards - `kl/coef` x KL when the KL "
          "goes in the reward. Before any whitening.", "Rises over training: the number the run optimises."),
        M("reward/non_score_mean", "reward units", "Mean of -`kl/coef` x the trajectory's KL: the part of "
          "`reward/total_mean` that is the KL penalty (0 when the KL goes in the loss).",
          "Small and negative; it grows in size with `kl/mean`."),
        M("reward/overlong_penalty_mean", "reward units", "Mean DAPO overlong shaping (0 to "
          "-`algorithm.overlong_penalty_factor`). Logged with `algorithm.overlong_buffer` > 0 only.",
          "Near 0: few responses run into the last `overlong_buffer` tokens."),
        M("reward/fn/<name>", "the function's", "Mean value of reward function `<name>` (`reward.fns`) over "
          "the batch's trajectories, before its weight.", "Rises for the components the task rewards."),
        M("reward/fn_total_mean", "reward units", "Mean weighted sum of the reward functions per trajectory. "
          "Logged when any reward function scored.", "Rises over training."),
        M("reward/fn_failed", "trajectories", "Trajectories whose reward function raised, timed out "
          "(`reward.fn_timeout_s`) or returned no finite number; they are left out of training.",
          "0; each failure is in the log, and too many stop the job (`env.max_failed_ratio`)."),
    )),
    Group("Groups", "Critic-free estimators only (`algorithm.advantage_estimator` grpo, rloo, reinforce; "
          "`apply_group_rule` in `rl_core/ppo/scoring.py`, `compute_advantages` in `rl_core/ppo/step.py`).", (
        M("groups/count", "groups", "Prompt groups in the batch.", "batch_size / group_size."),
        M("groups/incomplete", "groups", "Groups with fewer than `algorithm.group_size` members (a failed "
          "trajectory, or a stale one dropped in async mode).", "0."),
        M("groups/singleton", "groups", "Groups with one member left: their advantage is 0.", "0."),
        M("groups/zero_variance_frac", "fraction", "Share of trajectories whose group's total rewards are all "
          "equal: their advantages are 0 and they teach nothing.", "Well below 1; near 1 means the task is too "
          "hard or too easy for the policy (DAPO's `algorithm.filter_zero_variance_groups` resamples such groups)."),
    )),
    Group("Rollout correction", "Each token's loss weight for the gap between the engine that sampled it "
          "(pi_behaviour) and the trainer's pi_old (`rollout_correction_weights` in `rl_core/ppo/algorithms.py`, "
          "`algorithm.rollout_correction.*`). The ratio is pi_old / pi_behaviour per generated token.", (
        M("rollout_correction/ratio_mean", "ratio", "Mean ratio over generated tokens.",
          "Near 1; exactly 1 when pi_old is the engine's logprobs (`perf/old_logprobs_from_engine` = 1). A drift "
          "away from 1 over training points at the engine's precision or kernels."),
        M("rollout_correction/ratio_min", "ratio", "Smallest ratio of the step (over micro-batches and ranks).",
          "Near 1."),
        M("rollout_correction/ratio_max", "ratio", "Largest ratio of the step (over micro-batches and ranks).",
          "Near 1; `tis` caps a token's weight at `is_cap`."),
        M("rollout_correction/masked_frac", "fraction", "Share of generated tokens given weight 0 (the "
          "`mis-token` and `mis-sequence` modes drop tokens or rows outside [mask_low, mask_high]).",
          "0 for `tis` and `none`; small for the `mis-*` modes."),
    )),
    Group("Rollout", "What the step's generation did (`rollout_metrics` in `rl_core/rollout/metrics.py`, "
          "`rl_core/rollout/rollout.py`). Counts are over the batch's trajectories that did not fail.", (
        M("rollout/trajectories", "trajectories", "Trajectories in the batch.", "`algorithm.batch_size`."),
        M("rollout/failed", "trajectories", "Trajectories that failed (env error or timeout, reward function "
          "failure), left out of training.", "0; more than `env.max_failed_ratio` of a rollout stop the job."),
        M("rollout/wall_s", "seconds", "Wall time of the rollout that generated the batch.",
          "Steady from step to step."),
        M("rollout/tokens_per_s", "tokens/s", "Generated tokens / `rollout/wall_s`.", "Steady; compare runs "
          "on the same hardware."),
        M("rollout/generated_tokens", "tokens", "Tokens the policy generated in the batch (all turns).",
          "Follows the response lengths."),
        M("rollout/response_length_mean", "tokens", "Generated tokens per trajectory, mean (all turns).",
          "Moves with what the reward favours; a steady climb to `rollout.response_length` with "
          "`rollout/truncated_frac` near 1 means responses stop being finished."),
        M("rollout/response_length_min", "tokens", "Generated tokens of the shortest trajectory.", "Above 0."),
        M("rollout/response_length_max", "tokens", "Generated tokens of the longest trajectory.",
          "At most `rollout.response_length` x `rollout.max_turns`."),
        M("rollout/turns_mean", "turns", "Engine calls (assistant turns) per trajectory.",
          "1 for single-turn envs; between 1 and `rollout.max_turns` otherwise."),
        M("rollout/sequences_per_trajectory", "sequences", "Token sequences per trajectory: a new one starts "
          "when an observation does not extend the previous text.", "1 for single-turn and append-only envs."),
        M("rollout/env_reward_mean", "reward units", "Mean env reward per trajectory (as `reward/env_mean`, "
          "from the rollout's side).", "As `reward/env_mean`."),
        M("rollout/env_time_s", "seconds", "Time spent inside env `reset` and `step` calls, summed over the "
          "batch's trajectories (they run concurrently, so it can exceed `rollout/wall_s`).",
          "Small next to `rollout/wall_s` unless the env does real work (tools, sandboxes)."),
        M("rollout/truncated_frac", "fraction", "Share of trajectories whose last response was cut by a length "
          "limit instead of ending (EOS, a stop token, the env).",
          "Low for tasks with an end; 1 by design with `rollout.ignore_eos=true` (fixed-length responses)."),
        M("rollout/finish_reason/<reason>", "engine calls", "Engine calls of the batch that ended for "
          "`<reason>`: `stop` (EOS or a stop token), `length` (the token limit or the context), "
          "or another reason the engine gave.", "Mostly `stop` for tasks with an end."),
        M("rollout/envs_max_in_use", "envs", "Most envs leased at once so far in the run.",
          "At most `env.num_envs`; at the limit, trajectories waited for an env."),
        M("rollout/generate_calls", "calls", "/generate calls sent to the engines for the batch.",
          "Close to one per group (unseeded samples) or per sample (seeded), plus one per later turn."),
        M("rollout/first_wave_frac", "fraction", "Share of the batch's trajectories whose first turn went out in "
          "the first wave, together (`rl_core/rollout/first_turns.py`).", "1, or close to it."),
        M("rollout/reward_fn_s", "seconds", "Time the rollout waited on reward functions, summed over its scoring "
          "calls (once per batch, or once per group with dynamic sampling, where calls overlap).",
          "Small next to `rollout/wall_s`."),
        M("rollout/behaviour_logprob_gap", "nats per token", "Mean |pi_old - pi_behaviour| logprob over generated "
          "tokens, when the trainer recomputed pi_old (not logged when it took the engine's).",
          "Near 0 on CPU; larger when engine and trainer compute in different precisions."),
    )),
    Group("Dynamic sampling", "DAPO's group filter (`algorithm.filter_zero_variance_groups=true`; "
          "`rollout_until` in `rl_core/rollout/rollout.py`).", (
        M("rollout/groups_launched", "groups", "Groups launched to fill the batch.",
          "At most `filter_max_groups_factor` x the groups a batch needs."),
        M("rollout/groups_kept", "groups", "Groups kept for training (batch_size / group_size).", "Constant."),
        M("rollout/groups_dropped", "groups", "Finished groups dropped: all rewards equal, or a failed member.",
          "Below `rollout/groups_launched`; close to it means most prompts teach nothing."),
        M("rollout/groups_filled", "groups", "Dropped groups put back to fill the batch after "
          "`rollout/groups_launched` reached its limit.", "0."),
        M("rollout/samples_exhausted", "0/1", "1 when the prompt stream ran out before the batch was full.",
          "0."),
    )),
    Group("Conversation envs and agents", "Chat envs with tools (`envs/chat.py`) and agents (`envs/agent.py`).",
          (
        M("rollout/tool_calls_mean", "calls", "Tool calls per conversation trajectory.", "What the task needs."),
        M("rollout/tool_errors_mean", "calls", "Tool calls per conversation trajectory that ended in an error "
          "(kinds below).", "Falls as the policy learns the tools' formats."),
        M("rollout/tool_time_s_mean", "seconds", "Time in tool calls per conversation trajectory.",
          "Below `env.tool_timeout_s`."),
        M("rollout/template_divergences", "sequences", "Times in the batch a chat template re-rendered an earlier "
          "turn, so the trajectory went on in a new sequence (`envs/chat_tokens.py`).",
          "0 for append-only templates."),
        M("rollout/reprefill_tokens", "tokens", "Tokens sent to the engine again because of those divergences.",
          "0 for append-only templates."),
        M("rollout/tool_errors/unparsed", "calls", "Calls in the batch the tool parser (`env.tool_parser`) could not "
          "read. The kinds below are counts over the batch too.",
          "Falls over training."),
        M("rollout/tool_errors/unknown_tool", "calls", "Calls naming no tool of `env.tools`.", "0 or falling."),
        M("rollout/tool_errors/bad_arguments", "calls", "Calls whose arguments do not match the tool's schema.",
          "Falls over training."),
        M("rollout/tool_errors/raised", "calls", "Calls where the tool raised an exception.",
          "What the task makes likely; the model reads the error."),
        M("rollout/tool_errors/timed_out", "calls", "Calls past `env.tool_timeout_s`.", "0."),
        M("rollout/tool_errors/over_limit", "calls", "Calls past the env's limit of calls per turn, not run.",
          "0."),
        M("rollout/agent/<key>", "the agent's", "Mean over the batch of the number `<key>` an agent function "
          "returned beside `reward` (`envs/agent.py`).", "What the agent reports."),
    )),
    Group("Async mode", "The producer and the staleness bound (`trainer.mode=async`; "
          "`rl_core/ppo/collect.py`, `rl_core/rollout/service.py`). The first two are logged in sync mode too.", (
        M("async/dropped_stale", "trajectories", "Trajectories dropped because their oldest token is more than "
          "`async.max_staleness` versions old.", "0: the producer starts only batches that will be fresh enough."),
        M("async/staleness_max", "versions", "Largest policy-version lag of a trajectory in the batch (the "
          "step's version minus its oldest token's).", "0 in sync mode; at most `async.max_staleness`."),
        M("async/surplus_discarded", "trajectories", "Fresh trajectories beyond the batch size in the last batch "
          "taken, discarded.", "0; more when failures made an extra batch necessary."),
        M("async/batches_taken", "batches", "Batches the trainer took from the queue so far.",
          "One per step, plus one for each step that needed an extra batch."),
        M("async/batches_generated", "batches", "Batches the producer generated so far.",
          "Close to `async/batches_taken`: batches are not generated to be dropped."),
    )),
    Group("Time and throughput", "Wall time of a step's phases (`StepTimer`, `workers/trace.py`; `ppo_step` in "
          "`rl_core/ppo/job.py`).", (
        M("perf/step_s", "seconds", "The whole step: rollout, inference, train and sync (not the evaluation, "
          "the log or the checkpoint). In the SFT, DPO and reward-model jobs, the training step: forward, "
          "backward and optimizer step (`rl_core/step_loop.py`).", "Steady from step to step."),
        M("perf/rollout_s", "seconds", "Getting the batch: the rollout in sync mode, the wait for the queue in "
          "async mode.", "Steady; in async mode near 0 while generation keeps up with training."),
        M("perf/inference_s", "seconds", "Releasing engine memory and the forward passes: old and reference "
          "logprobs, values, reward-model scores.", "Below `perf/train_s`: forward passes only."),
        M("perf/train_s", "seconds", "Scores, advantages and the PPO epochs.", "Grows with noptepochs x tokens."),
        M("perf/sync_s", "seconds", "Pushing the weights to every engine and the probe check.",
          "A small share of the step."),
        M("perf/eval_s", "seconds", "The evaluation after this step. Logged on evaluation steps only.",
          "Steady between evaluations."),
        M("perf/release_s", "seconds", "Engines freeing their KV cache and weights before the trainer runs "
          "(sync mode); 0 when they keep them.", "0 when the memory plan fits."),
        M("perf/tokens_per_s", "tokens/s", "All tokens of the step's trajectories (prompts, responses, "
          "observations) / `perf/step_s`.", "Steady; compare runs on the same hardware."),
        M("perf/episodes_per_s", "episodes/s", "Trajectories / `perf/step_s`.", "Steady."),
        M("perf/padding_fraction", "fraction", "Share of the token grid the trained micro-batches ran on that was "
          "padding (packed rows: the unfilled part). The SFT job logs rank 0's over its micro-batches of the step.",
          "Low; `algorithm.packing=true` (SFT: `train.packing=true`) brings it near 0."),
        M("perf/train_grid_tokens", "tokens", "Token positions one rank's micro-batches of a minibatch ran on "
          "(padded or packed rows' size).", "Near the rank's real tokens when padding is low."),
        M("perf/old_logprobs_from_engine", "0/1", "1 when pi_old was the engine's sampling logprobs (no "
          "recomputation: `algorithm.old_logprobs`), 0 when the trainer recomputed it.",
          "1 in sync mode when engine and trainer agree on the probe (CPU); 0 in async mode."),
    )),
    Group("Memory", "The trainer's memory and the engines' release (`rl_core/step_loop.py`, `rl_core/ppo/job.py`).", (
        M("memory/trainer_peak_gib", "GiB", "On a GPU, rank 0's peak allocated CUDA memory during the step; on "
          "CPU, rank 0's peak resident memory so far in the run (the Python runtime included).",
          "Below the memory plan's trainer total and the device."),
        M("memory/released", "0/1", "1 when the engines release their memory every step (sync mode; "
          "`rollout.release_memory`, the memory plan).", "0 when trainer and engine fit together."),
    )),
    Group("Memory plan", "The plan made before the engines start (`workers/memory_plan.py`; see "
          "[Memory plan](memory.md#memory-plan)), logged once, in the run's first row. Sizes are per device: "
          "one trainer rank and its engine. When the plan fits, the eight parts from `trainer_params_gib` to "
          "`reserve_gib` add up to at most `memory_plan/device_gib`.", (
        M("memory_plan/trainer_params_gib", "GiB", "Trained weights, sharded over the ranks (0 with "
          "`model.cpu_offload`).", "See `memory_plan/fits`."),
        M("memory_plan/trainer_grads_gib", "GiB", "Their gradients.", "See `memory_plan/fits`."),
        M("memory_plan/trainer_optimizer_gib", "GiB", "Their optimizer states.", "See `memory_plan/fits`."),
        M("memory_plan/trainer_frozen_gib", "GiB", "Frozen models' weights: reference, reward model.",
          "See `memory_plan/fits`."),
        M("memory_plan/trainer_activations_gib", "GiB", "Activations of one micro-batch, LM-head logits included.",
          "See `memory_plan/fits`."),
        M("memory_plan/engine_weights_gib", "GiB", "The engine's weights.", "See `memory_plan/fits`."),
        M("memory_plan/engine_kv_gib", "GiB", "The engine's KV pool.", "See `memory_plan/fits`."),
        M("memory_plan/reserve_gib", "GiB", "Fixed reserve: runtimes, CUDA contexts, fragmentation.",
          "See `memory_plan/fits`."),
        M("memory_plan/device_gib", "GiB", "Memory one rank and its engine share (`rollout.device_memory_gb`, "
          "or the device's).", "See `memory_plan/fits`."),
        M("memory_plan/kv_tokens", "tokens", "The engine's KV pool size.", "`memory_plan/work_tokens`; fewer "
          "(capped by memory, or `rollout.kv_tokens`) makes requests queue for KV."),
        M("memory_plan/work_tokens", "tokens", "KV the rollout's sequences in flight need on one engine.",
          "See `memory_plan/kv_tokens`."),
        M("memory_plan/trainer_process_gib", "GiB", "On CPU only: the trainer process's planned peak resident "
          "memory: its parts, its runtime, and twice the policy's size while it loads whole.",
          "Close to `memory/trainer_peak_gib`, the trainer's measured peak."),
        M("memory_plan/engine_process_gib", "GiB", "On CPU only: the engine process's planned peak resident memory: "
          "its weights, its KV pool and its runtime.", "See `memory_plan/fits`."),
        M("memory_plan/fits", "0/1", "1 when trainer and engine fit on the device together (then the engines "
          "never release memory under `rollout.release_memory=auto`).", "1 where memory allows it."),
    )),
    Group("Weight sync", "Pushing the new weights into rank 0's engine after the update (`RankEngine.push` in "
          "`workers/engines/rank_engine.py`, `workers/engines/weights.py`).", (
        M("weight_sync/push_s", "seconds", "The weight-update session: packing and sending every bucket.",
          "Steady; grows with the model."),
        M("weight_sync/pack_s", "seconds", "The part of `weight_sync/push_s` spent packing buckets.",
          "A fraction of `weight_sync/push_s`."),
        M("weight_sync/bytes", "bytes", "Bytes pushed (the model in the engine's dtype).", "Constant."),
        M("weight_sync/buckets", "buckets", "Buckets sent (`rollout.weight_bucket_mb` each at most).", "Constant."),
        M("weight_sync/resume_s", "seconds", "Time resuming released engine memory around the push; 0 when it "
          "was not released.", "0 when the memory plan fits."),
        M("weight_sync/probe_s", "seconds", "Time of the check after the push: the engine's weight version and "
          "its logprobs of a fixed probe sequence.", "Small."),
        M("weight_sync/probe_gap", "nats per token", "Mean |engine - trainer| logprob on the probe sequence.",
          "About 0 where both compute in float32 (CPU); past `rollout.weight_check_tolerance` the job stops."),
    )),
    Group("Evaluation", "Held-out prompts (`data.eval_path`) at step 0, every `eval.every` steps and at the end, "
          "with the `eval.*` sampling (`eval_metrics` in `rl_core/ppo/evaluation.py`). A failed sample counts as "
          "wrong, with reward 0.", (
        M("eval/reward_mean", "reward units", "Mean total reward per sample: the training score (penalties and "
          "shaping included) plus env rewards. In the SFT job (with `eval.reward_fn`): mean `eval.reward_fn` score "
          "of the greedy completions of `eval/accuracy`.", "Rises over training."),
        M("eval/accuracy", "fraction", "Share of samples whose accuracy function (`eval.accuracy_fn`, else the "
          "first of `reward.fns`) is above 0. Logged with reward functions only. In the SFT job (with "
          "`eval.reward_fn`): share of the first `eval.generate_rows` held-out rows whose greedy completion "
          "(`eval.max_new_tokens` at most) `eval.reward_fn` scores above 0.", "Rises over training."),
        M("eval/pass@<k>", "fraction", "Unbiased pass@k over the prompts (Chen et al. 2021) for k = 1, 2, 4, ... "
          "up to `eval.n`, from the same correctness as `eval/accuracy`.", "pass@1 equals `eval/accuracy`; "
          "larger k is higher."),
        M("eval/fn/<name>", "the function's", "Mean value of reward function `<name>` over the samples.",
          "Rises for the components the task rewards."),
        M("eval/prompts", "prompts", "Held-out prompts evaluated.", "`eval.max_prompts`, or the whole set."),
        M("eval/failed", "samples", "Samples whose trajectory failed.", "0."),
        M("eval/prompts_skipped_long", "prompts", "Held-out prompts skipped as longer than "
          "`data.max_prompt_length`.", "0."),
        M("eval/response_length_mean", "tokens", "Tokens of the final response, mean over samples.",
          "Moves with what the reward favours."),
        M("eval/truncated_frac", "fraction", "Share of samples cut by the length limit.", "Low."),
    )),
    Group("Profiling and checkpoints", "Logged on some steps only.", (
        M("profile/device_reads", "reads", "Reads back to the host of tensors on the training device in a "
          "profiled step (`trainer.profile_steps`; `rl_core/profiling.py`). On a GPU each is a stall.",
          "3 for a sync GRPO step (see [Profiling a step](walkthrough.md#profiling-a-step))."),
        M("profile/kernel_ops", "ops", "Outermost aten ops the trainer's thread dispatched in a profiled step "
          "(each at least one kernel launch on a GPU).", "Steady for the same shapes."),
        M("checkpoint/failed", "checkpoints", "Checkpoints that could not be written so far "
          "(`trainer.on_checkpoint_error=continue`); in every row after the first failure.", "Absent."),
    )),
)
