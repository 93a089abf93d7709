"""The metrics of the fixed-data jobs: SFT, DPO and the reward model (the ones they share, then each job's)."""

from __future__ import annotations

from rl_core.metric_docs.schema import Group, Metric as M

FINETUNE_GROUPS: tuple[Group, ...] = (
    Group("SFT, DPO and reward model: shared", "The training step's numbers the three fixed-data jobs share "
          "(`rl_core/finetune.py`, `rl_core/training_run.py`). Each logs a row per step from step 1 (the SFT and DPO "
          "jobs also a step-0 row with the evaluation before training); `perf/step_s`, `perf/eval_s`, "
          "`memory/trainer_peak_gib`, `profile/*` and `checkpoint/failed` are as in their own groups.", (
        M("epoch", "epochs", "SFT and DPO: epochs of the training data done before this step's batch, "
          "(step - 1) / steps per epoch.", "Grows by 1 / steps per epoch each step, to just below `train.epochs`."),
        M("train/loss", "loss", "The step's batch loss, before its update. SFT: negative log-likelihood per "
          "trained token (nats; response or assistant tokens only). DPO: mean over pairs of "
          "`-log sigmoid(m)`, m the pair's reward margin (see `train/reward_margin`); with `dpo.label_smoothing` "
          "e, `-(1-e) log sigmoid(m) - e log sigmoid(-m)`. Reward model: mean over comparisons of the preference loss of its normalised scores: "
          "`-log sigmoid(best - other - margin)` for pairs (margin with llama2-style data, else 0), softmax "
          "cross-entropy over the responses for best-of-N.", "Falls, noisily batch to batch. DPO starts at "
          "log 2 = 0.693 when the reference is the initial policy; far below `eval/loss` is overfitting."),
        M("train/lr", "learning rate", "The learning rate this step's update used.", "SFT and DPO: rises over "
          "`train.warmup_steps`, then holds at `train.lr` or falls linearly to 0 (`train.schedule`). Reward "
          "model: `train.lr`, falling linearly towards 0 over the epoch."),
        M("train/grad_norm", "L2 norm", "Global gradient norm before clipping (`train.max_grad_norm`). A "
          "non-finite norm skips that update.", "Finite and without lasting jumps."),
        M("eval/loss", "loss", "SFT: `train/loss` over the held-out rows (`data.eval_path`, `data.eval_max_rows` "
          "at most). DPO: `train/loss` over the held-out pairs (`data.test_path`, else `data.heldout_fraction` of the train pairs; `data.eval_max_pairs` at most). "
          "At step 0, every `eval.every` steps and at the end.", "Falls, then levels off; rising again while "
          "`train/loss` falls is overfitting. DPO's is log 2 at step 0 when the reference is the initial policy."),
    )),
    Group("SFT", "The supervised fine-tuning job (`rl_core/sft/training.py`): next-token loss on the trained "
          "tokens (the response, or the assistant turns).", (
        M("train/token_accuracy", "fraction", "Share of the batch's trained tokens that the model's argmax "
          "prediction gets right (before the update).", "Rises with falling `train/loss`."),
        M("train/tokens", "tokens", "Trained tokens (those in the loss) of the step's whole batch; the loss is "
          "their mean.", "Above 0; varies with the rows drawn."),
        M("eval/token_accuracy", "fraction", "`train/token_accuracy` over the held-out rows.",
          "Rises with falling `eval/loss`."),
    )),
    Group("DPO", "The DPO job (`rl_core/dpo/training.py`). `pi` and `ref`: the summed log-likelihood of a "
          "response (prompt tokens excluded) under the policy and under the frozen reference "
          "(`model.reference_path`, else the initial policy); a pair's implicit reward is "
          "`dpo.beta` x (pi - ref). Each `train/*` is the mean over the step's pairs before the update, each "
          "`eval/*` the same over the held-out pairs (see `eval/loss`).", (
        M("train/reward_margin", "nats x beta", "Mean over pairs of chosen minus rejected implicit reward: "
          "`dpo.beta` x ((pi_c - ref_c) - (pi_r - ref_r)).", "0 at the start when the reference is the initial policy, then grows above 0."),
        M("train/reward_accuracy", "fraction", "Share of pairs whose chosen response has the strictly larger "
          "implicit reward (ties count as wrong).", "0 at the start when the reference is the initial "
          "policy (every margin 0), then well above 0.5."),
        M("train/reward_chosen", "nats x beta", "Mean implicit reward of the chosen responses: `dpo.beta` x "
          "(pi_c - ref_c).", "Above `train/reward_rejected`; it may fall below 0 as well, by less."),
        M("train/reward_rejected", "nats x beta", "Mean implicit reward of the rejected responses: `dpo.beta` x "
          "(pi_r - ref_r).", "Falls below 0."),
        M("train/logps_chosen", "nats", "Mean summed log-likelihood of the chosen responses under the policy "
          "(pi_c).", "Level or slowly falling; a steep fall means the policy drifts from the data (a larger `dpo.beta` holds "
          "it nearer the reference)."),
        M("train/logps_rejected", "nats", "Mean summed log-likelihood of the rejected responses under the policy "
          "(pi_r).", "Falls faster than `train/logps_chosen`."),
        M("eval/reward_margin", "nats x beta", "`train/reward_margin` over the held-out pairs.",
          "0 at step 0 when the reference is the initial policy, then above 0."),
        M("eval/reward_accuracy", "fraction", "`train/reward_accuracy` over the held-out pairs.",
          "0 at step 0 when the reference is the initial policy, then above 0.5."),
        M("eval/reward_chosen", "nats x beta", "`train/reward_chosen` over the held-out pairs.",
          "Above `eval/reward_rejected`."),
        M("eval/reward_rejected", "nats x beta", "`train/reward_rejected` over the held-out pairs.",
          "Falls below 0."),
        M("eval/logps_chosen", "nats", "`train/logps_chosen` over the held-out pairs.",
          "Level or slowly falling."),
        M("eval/logps_rejected", "nats", "`train/logps_rejected` over the held-out pairs.",
          "Falls faster than `eval/logps_chosen`."),
        M("eval/rm_score", "reward units", "With `eval.reward_model_path`: mean normalised reward-model score "
          "of `eval.response_length` tokens sampled at `eval.temperature` (fixed seed) after each of "
          "`eval.prompts` distinct held-out prompts.", "Rises over training when the reward model agrees "
          "with the preference data."),
    )),
    Group("Reward model", "The reward-model job (`rl_core/reward_model/training.py`): one epoch over the "
          "comparisons, a row per minibatch of `train.batch_size`; its shared `train/*` are above. The "
          "held-out accuracy and the normalisation's gain and bias come once, at the end, in "
          "`<run_dir>/metrics.json`, not in the rows.", (
        M("train/accuracy", "fraction", "Share of the batch's comparisons whose preferred response scores "
          "strictly above every other (ties count as wrong), before the update.",
          "About chance (1 / responses per comparison) at the start, then rising well above it."),
        M("epoch/loss", "loss", "`train/loss` averaged over every comparison of the epoch so far (this step's "
          "included); at the last step the `train_loss` of `<run_dir>/metrics.json`.",
          "Falls more smoothly than `train/loss`."),
        M("epoch/accuracy", "fraction", "`train/accuracy` over every comparison of the epoch so far; at the last "
          "step the `train_accuracy` of `<run_dir>/metrics.json`.", "Rises from about chance."),
    )),
)
