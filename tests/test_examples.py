"""The shipped examples, each run for one step as a user runs them (torchrun, the recipe, overrides that only
shrink it): the agent recipe (the example agent's tool called by the shipped tool-calling policy), the RLOO,
DAPO and GSPO variants of the arithmetic recipe, a checkpoint resumed, and `rl-core export` of a checkpoint
to a Hugging Face directory. Every recipe checkpoints by default (the PPO/GRPO ones on their last step too).

    python -m pytest tests/test_examples.py
"""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from tests.jobs import read_metrics, run_to_end, torchrun, undocumented_metrics

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"
# The recipe cut to one step of 2 prompts x 8 responses on one rank, without held-out evaluation or final export.
ONE_STEP = ["algorithm.batch_size=16", "env.num_envs=16", "trainer.total_episodes=16", "data.eval_path=null",
            "eval.every=0", "trainer.progress=false", "trainer.export_hf=false"]


def shipped(policy: str, problems: str) -> list[str]:
    """The recipe's offline names given as the shipped assets they name (assets/): the same files, without the
    job's check of every asset build at start (seconds per run; resolving the names is the recipes' own tests')."""
    from offline.assets import default_assets_root

    root = default_assets_root()
    return [f"model.path={root / policy}", f"data.train_path={root / problems / 'train.jsonl'}"]


def run_recipe(config: str, run_dir: Path, *overrides: str) -> str:
    """One step of the shipped recipe `config` (the overrides after ONE_STEP win); its output."""
    assets = shipped(*(("tiny-tools-arithmetic", "tools-arithmetic") if "agent" in config else
                       ("tiny-arithmetic", "arithmetic")))
    return run_to_end(torchrun("rl_core.train", config, *ONE_STEP, *assets, f"trainer.run_dir={run_dir}", *overrides,
                               ranks=1), timeout=300, cwd=REPO)


def recipe(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def test_every_recipe_checkpoints_by_default_and_its_last_step_is_a_checkpoint():
    names = sorted(path.name for path in CONFIGS.glob("*.yaml"))
    assert len(names) >= 12
    for name in names:
        trainer = recipe(name)["trainer"]
        assert trainer.get("save_every", 0) > 0, f"{name} writes no checkpoint: set trainer.save_every"
        if "algorithm" in recipe(name):  # the PPO/GRPO recipes: the last step is a checkpoint too
            steps, rest = divmod(trainer["total_episodes"], recipe(name)["algorithm"]["batch_size"])
            assert rest == 0 and steps % trainer["save_every"] == 0, name


@pytest.fixture(scope="module")
def rloo_run(tmp_path_factory):
    """Step 1 of the RLOO recipe, checkpointed (the recipes' cadence, brought down to this one step)."""
    run_dir = tmp_path_factory.mktemp("rloo") / "run"
    run_recipe("rloo_arithmetic.yaml", run_dir, "trainer.save_every=1")
    return run_dir


@pytest.mark.timeout(400)
@pytest.mark.parametrize("config", ["rloo_arithmetic.yaml", "dapo_arithmetic.yaml", "gspo_arithmetic.yaml"])
def test_the_variants_of_the_arithmetic_recipe_train_a_step(config, request, tmp_path):
    run_dir = tmp_path / "run"
    if config == "rloo_arithmetic.yaml":
        run_dir = request.getfixturevalue("rloo_run")  # the run the resume test goes on with
    elif config == "gspo_arithmetic.yaml":  # 4 prompts: the first 2 are all answered right, so teach nothing
        run_recipe(config, run_dir, "algorithm.batch_size=32", "trainer.total_episodes=32")
    else:
        run_recipe(config, run_dir)
    row = read_metrics(run_dir)[0]
    assert row["step"] == 1 and row["rollout/failed"] == 0 and "policy/loss" in row
    assert undocumented_metrics([row]) == []
    if config == "rloo_arithmetic.yaml":  # the KL goes into the reward, not into the loss
        assert "kl/mean" in row and "policy/kl_loss" not in row
    if config == "dapo_arithmetic.yaml":  # dynamic sampling kept 2 groups of those it launched; no KL term at all
        assert row["rollout/groups_kept"] == 2 and row["rollout/groups_launched"] >= 2
        assert row["rollout/groups_launched"] - row["rollout/groups_dropped"] + row["rollout/groups_filled"] == 2
        assert "policy/kl_loss" not in row
    if config == "gspo_arithmetic.yaml":
        # One ratio per sequence, in a narrow range: after the first minibatch's update, a sequence of the second
        # that teaches something is clipped whole once its ratio leaves [1 - 3e-4, 1 + 4e-4] (0.09 of this step's
        # tokens; the GRPO recipe's per-token range clips 0.005 of the same step's).
        assert row["policy/clipfrac"] > 0.03 and "policy/kl_loss" in row


@pytest.mark.timeout(400)
def test_a_checkpoint_resumes_at_the_next_step_and_exports_to_a_hugging_face_directory(rloo_run, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from rl_core.console import find_checkpoint, main

    run_dir = rloo_run
    first = run_dir / "checkpoints" / "step_00000001"
    assert json.loads((first / "trainer_state.json").read_text())["step"] == 1
    # The documented command: the same recipe, a longer run, trainer.resume=auto (and here the job's own export).
    output = run_recipe("rloo_arithmetic.yaml", run_dir, "trainer.save_every=1", "trainer.total_episodes=32",
                        "trainer.resume=auto", "trainer.export_hf=true")
    assert f"resumed from {first} at step 1" in output
    assert [row["step"] for row in read_metrics(run_dir)] == [1, 2]
    second = run_dir / "checkpoints" / "step_00000002"
    assert find_checkpoint(run_dir) == (second, run_dir)  # a run directory: its newest checkpoint

    out = tmp_path / "exported"
    main(["export", str(second), str(out)])  # `rl-core export`, in this process (it starts no job)
    assert f"exported {second} (step 2) to {out}" in capsys.readouterr().out
    start = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["path"]  # the recipe's policy
    ids = torch.tensor([[5, 17, 300, 42, 9, 101]])
    with torch.no_grad():
        logits = {name: AutoModelForCausalLM.from_pretrained(path).eval()(ids).logits
                  for name, path in [("exported", out), ("final", run_dir / "final"), ("start", start)]}
    # The checkpoint at the last step is the model the job exported at its end, and training moved it.
    assert (logits["exported"] - logits["final"]).abs().max() == 0
    assert (logits["exported"] - logits["start"]).abs().max() > 1e-4
    assert (out / "tokenizer.json").is_file() and (out / "chat_template.jinja").is_file()


@pytest.mark.parametrize("source, said", [
    ("missing", "does not exist; give a run directory (trainer.run_dir) or one of its checkpoints/step_N directories"),
    ("empty", "is neither a run directory (no config.yaml) nor a checkpoint (no trainer_state.json)"),
    ("unsaved_run", "has no complete checkpoint in checkpoints/: a job writes one every trainer.save_every steps"),
])
def test_export_of_what_is_not_a_checkpoint_is_one_line_and_status_2(source, said, tmp_path, capsys):
    from rl_core.console import main

    if source != "missing":
        (tmp_path / source).mkdir()
    if source == "unsaved_run":  # a run with save_every=0
        (tmp_path / source / "config.yaml").write_text("model: {path: tiny}\n")
    with pytest.raises(SystemExit) as stopped:
        main(["export", str(tmp_path / source), str(tmp_path / "out")])
    lines = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2 and len(lines) == 1 and said in lines[0], lines
    assert lines[0].startswith("rl-core export: error: ") and not (tmp_path / "out").exists()


def test_export_of_a_reward_model_checkpoint_says_what_it_exports(tmp_path, capsys):
    from rl_core.console import main

    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    (checkpoint / "reward_model").mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"step": 2}')
    with pytest.raises(SystemExit) as stopped:
        main(["export", str(checkpoint), str(tmp_path / "out")])
    (line,) = capsys.readouterr().err.splitlines()
    assert stopped.value.code == 2
    assert f"{checkpoint} holds reward_model, not a policy (actor/model/policy)" in line


@pytest.mark.timeout(300)
def test_the_agent_recipe_trains_the_example_agent_whose_tool_the_policy_calls(tmp_path):
    run_dir = tmp_path / "run"
    run_recipe("grpo_agent_arithmetic.yaml", run_dir)
    (row,) = read_metrics(run_dir)
    assert undocumented_metrics([row]) == []
    assert row["rollout/failed"] == 0 and row["rollout/template_divergences"] == 0
    assert row["rollout/agent/tool_calls"] > 0  # the agent's own count of the calls it ran
    # A call the policy wrote, the agent's tool's result sent back, then the answer: the result is the product.
    call = re.compile(r'"expr": "(\d+) \* (\d+)"\}\}</tool_call>\nTool: (\d+)\n')
    calls = [call.search(json.loads(line)["query"]) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    products = [(int(m[1]) * int(m[2]), int(m[3])) for m in calls if m]
    assert products and all(want == got for want, got in products), products
