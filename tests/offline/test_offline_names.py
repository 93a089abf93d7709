"""The registry of offline names (rl_core/offline_names.py): the names the builders resolve, and a job whose
config names none loads no builder."""

import subprocess
import sys
import textwrap

from rl_core.offline_names import OFFLINE_NAMES, names_offline_assets


def test_the_registry_lists_every_name_the_builders_resolve():
    from offline import ARITHMETIC, ARITHMETIC_TEACHER, CHAT_ARITHMETIC, TOOLS_ARITHMETIC, TOOLS_ARITHMETIC_SFT
    from offline.arithmetic import ARITHMETIC_SFT
    from offline.prepare import MODEL_NAMES
    from offline.vision_shapes import VISION_SHAPES

    assert OFFLINE_NAMES == {"tiny", ARITHMETIC, ARITHMETIC_SFT, ARITHMETIC_TEACHER, TOOLS_ARITHMETIC,
                             TOOLS_ARITHMETIC_SFT, CHAT_ARITHMETIC, VISION_SHAPES}
    assert set(MODEL_NAMES) <= OFFLINE_NAMES  # the policies any model key may name


def test_a_config_of_real_paths_resolves_without_importing_a_builder(tmp_path):
    """In a fresh interpreter, as an entry point runs it: real paths pass through untouched, a path that is no model
    is one line naming its key, and no module of `offline/` is imported; the shipped recipe, which names "tiny",
    is resolved by the builders to shipped paths."""
    from offline.assets import default_assets_root

    policy = default_assets_root() / "tiny-gpt2"  # a real model directory, given by its path
    script = textwrap.dedent(f"""
        import sys
        from rl_core.config import load_config
        from rl_core.offline_names import offline_resolver
        from rl_core.sft.config import SFTConfig, validate

        real = ["model.path={policy}", "model.tokenizer_path=null", "data.train_path={tmp_path}/rows.jsonl",
                "data.eval_path=null", "eval.every=0"]
        cfg = load_config("sft_arithmetic.yaml", real, SFTConfig, validate)
        prepare = offline_resolver("sft")
        assert prepare(cfg, print) is cfg and cfg.model.path == "{policy}"
        try:
            prepare(load_config("sft_arithmetic.yaml", [*real, "model.path={tmp_path}/nope"], SFTConfig, validate), print)
        except Exception as error:
            print("refused:", error)
        assert not [name for name in sys.modules if name == "offline" or name.startswith("offline.")]
        shipped = prepare(load_config("sft_arithmetic.yaml", [], SFTConfig, validate), print)
        assert "offline.prepare" in sys.modules
        print(shipped.model.path, shipped.data.train_path)
    """)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert f"refused: model.path={tmp_path}/nope does not exist" in ran.stdout, ran.stdout
    model_path, train_path = ran.stdout.split()[-2:]
    assert not {model_path, train_path} & OFFLINE_NAMES
    assert model_path.endswith("tiny-gpt2") and train_path.endswith(".jsonl"), ran.stdout


def test_any_value_that_is_an_offline_name_counts():
    from rl_core.config import load_config
    from rl_core.ppo.config import PPOConfig

    real = ["model.path=/m", "reward.model_path=null", "data.train_path=/p.jsonl", "data.eval_path=null"]
    assert not names_offline_assets(load_config("ppo_sentiment.yaml", real, PPOConfig))
    assert names_offline_assets(load_config("ppo_sentiment.yaml", [*real, "data.eval_path=tiny"], PPOConfig))
    assert not names_offline_assets(load_config("ppo_sentiment.yaml", [*real, "data.eval_path=/tiny"], PPOConfig))
