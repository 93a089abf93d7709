"""The arithmetic recipe's distillation teacher (offline/arithmetic_teacher.py): built from the student with the
student's very tokenizer, recorded so a changed recipe rebuilds it, and named by an offline name any model key
may give."""

import dataclasses
import json
from types import SimpleNamespace

import pytest

from offline import ARITHMETIC_TEACHER
from offline.arithmetic import ensure_arithmetic_assets
from offline.arithmetic_teacher import (SMALL_SETTINGS, TEACHER_DIR, TOKENIZER_FILES, ensure_arithmetic_teacher,
                                        expected_settings, slip_free_rows)
from offline.assets import default_assets_root
from rl_core.rewards.math import answer_reward


class WouldBuild(Exception):
    pass


def refuse_to_build(line: str) -> None:
    raise WouldBuild(line)  # every build logs before it starts


def _tokenizer_bytes(directory):
    return {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}


@pytest.fixture(scope="module")
def small_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("assets")
    ensure_arithmetic_teacher(root, small=True, log=lambda *_: None)
    return root


def test_the_small_teacher_builds_with_the_students_tokenizer_bytes_and_records_its_accuracy(small_root):
    teacher = small_root / TEACHER_DIR
    student = ensure_arithmetic_assets(small_root, small=True, log=refuse_to_build).model_dir
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(_tokenizer_bytes(teacher))
    assert _tokenizer_bytes(teacher) == _tokenizer_bytes(student)
    assert (teacher / "model.safetensors").read_bytes() != (student / "model.safetensors").read_bytes()
    record = json.loads((teacher / "build.json").read_text())
    assert record["settings"] == expected_settings(SMALL_SETTINGS, student, small=True)
    assert record["settings"]["student"] == json.loads((student / "build.json").read_text())["settings"]
    assert 0.0 <= record["heldout_accuracy"] <= 1.0 and record["final_loss"] > 0
    assert ensure_arithmetic_teacher(small_root, small=True, log=refuse_to_build) == teacher  # cached


def test_a_changed_recipe_is_not_mistaken_for_the_built_teacher(small_root):
    student = small_root / "tiny-arithmetic"
    built = json.loads((small_root / TEACHER_DIR / "build.json").read_text())["settings"]
    for change in ({"sft_overrides": ("train.max_steps=11", "train.batch_size=8", "train.schedule=constant")},
                   {"seed": SMALL_SETTINGS.seed + 1}):
        assert expected_settings(dataclasses.replace(SMALL_SETTINGS, **change), student, small=True) != built


def test_the_fine_tuning_rows_are_slip_free_and_not_the_held_out_problems(small_root):
    rows = slip_free_rows(SMALL_SETTINGS, small=True)
    assert len(rows) == SMALL_SETTINGS.problems
    for row in rows:
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert answer_reward(row["messages"][-1]["content"], row) == 1.0  # every final line right
    held_out = (small_root / "arithmetic" / "eval.jsonl").read_text().splitlines()
    assert [json.loads(line)["messages"] for line in held_out] != [row["messages"][:1] for row in rows[:len(held_out)]]


def test_the_offline_name_resolves_to_the_shipped_teacher_at_any_model_key():
    from offline.prepare import MODEL_NAMES, offline_model_path, resolve_model_key
    from rl_core.offline_names import OFFLINE_NAMES

    assert ARITHMETIC_TEACHER in OFFLINE_NAMES and ARITHMETIC_TEACHER in MODEL_NAMES
    shipped = default_assets_root() / TEACHER_DIR
    assert offline_model_path(ARITHMETIC_TEACHER, refuse_to_build) == str(shipped)
    cfg = SimpleNamespace(distill=SimpleNamespace(teacher_path=ARITHMETIC_TEACHER),
                          model=SimpleNamespace(path="/some/model"))
    resolve_model_key(cfg, "distill.teacher_path", refuse_to_build)
    resolve_model_key(cfg, "model.path", refuse_to_build)
    assert cfg.distill.teacher_path == str(shipped) and cfg.model.path == "/some/model"


def test_a_recipe_naming_the_teacher_as_its_policy_gets_the_shipped_directory():
    from rl_core.config import load_config
    from rl_core.offline_names import offline_resolver
    from rl_core.ppo.config import PPOConfig

    cfg = load_config("grpo_arithmetic.yaml", [f"model.path={ARITHMETIC_TEACHER}"], PPOConfig)
    resolved = offline_resolver("ppo")(cfg, refuse_to_build)
    assert resolved.model.path == str(default_assets_root() / TEACHER_DIR)


def test_the_shipped_teacher_shares_the_students_tokenizer_and_beats_it():
    root = default_assets_root()
    teacher, student = root / TEACHER_DIR, root / "tiny-arithmetic"
    assert _tokenizer_bytes(teacher) == _tokenizer_bytes(student)
    assert json.loads((teacher / "build.json").read_text())["heldout_accuracy"] >= 0.97
