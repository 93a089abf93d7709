"""The vision recipe's shipped pictures (offline/vision_shapes.py): every answer is what its picture shows, read
back from the pixels; no held-out picture is a training picture; the annotator slips only where SLIPS says;
the recipe's offline name resolves to the shipped files without a build."""

import json
import random

import pytest

from offline.assets import default_assets_root
from offline.vision_shapes import COLOURS, QUESTIONS, SIZE, SLIPS, VISION_SHAPES, VisionShapesPaths, slipped
from workers.vision import load_images

BACKGROUND = (245, 245, 240)


def read_rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def seen(image) -> dict[str, str]:
    """The count (quadrants holding any shape pixel) and colour (the nearest of COLOURS to the shape pixels)."""
    pixels = image.load()
    half = SIZE // 2
    quadrants, shape = set(), []
    for y in range(SIZE):
        for x in range(SIZE):
            if sum(abs(a - b) for a, b in zip(pixels[x, y], BACKGROUND)) > 60:
                quadrants.add((x // half, y // half))
                shape.append(pixels[x, y])
    mean = [sum(channel) / len(shape) for channel in zip(*shape)]
    colour = min(COLOURS, key=lambda name: sum((a - b) ** 2 for a, b in zip(COLOURS[name], mean)))
    return {"count": str(len(quadrants)), "colour": colour}


@pytest.fixture(scope="module")
def shipped():
    paths = VisionShapesPaths.under(default_assets_root())
    return {"train": read_rows(paths.train_file), "eval": read_rows(paths.eval_file)}


def test_every_answer_is_what_the_picture_shows_and_the_held_out_pictures_are_new(shipped):
    asked = {text: question for question, text in QUESTIONS.items()}
    for split, rows in shipped.items():
        kinds = set()
        for row in rows[:400] if split == "train" else rows:  # (400 training pictures: a second, not ten)
            (image,) = load_images(row["images"])
            assert image.size == (SIZE, SIZE)
            content = row["messages"][0]["content"]
            assert content[0] == {"type": "image"}
            question = asked[content[1]["text"]]
            assert row["answer"] == seen(image)[question], (split, row["answer"], question)
            kinds.add((question, row["answer"]))
        assert len(kinds) == 8, f"{split}: every count and colour is asked"  # 4 counts + 4 colours
    assert not {row["images"][0] for row in shipped["eval"]} & {row["images"][0] for row in shipped["train"]}
    assert len(shipped["eval"]) == 200 and len(shipped["train"]) == 3000


def test_the_annotator_slips_only_to_the_named_neighbour():
    rng = random.Random(0)
    for question, answers in (("count", "1234"), ("colour", sorted(COLOURS))):
        for answer in answers:
            written = {slipped({"question": question, "answer": answer}, rng, 0.6) for _ in range(200)}
            assert written == ({answer, SLIPS[question][answer]} if answer in SLIPS[question] else {answer})


def test_the_recipe_names_the_shipped_policy_and_pictures_without_building_them():
    from rl_core.config import load_config
    from rl_core.offline_names import OFFLINE_NAMES, offline_resolver
    from rl_core.ppo.config import PPOConfig

    def refuse_to_build(line):
        raise AssertionError(f"the shipped vision assets were rebuilt: {line}")

    assert VISION_SHAPES in OFFLINE_NAMES
    cfg = offline_resolver("ppo")(load_config("grpo_vision_shapes.yaml", [], PPOConfig), refuse_to_build)
    root = default_assets_root()
    assert cfg.model.path == str(root / VISION_SHAPES)
    assert (cfg.data.train_path, cfg.data.eval_path) == (str(root / "vision-shapes" / "train.jsonl"),
                                                         str(root / "vision-shapes" / "eval.jsonl"))
    assert not cfg.algorithm.share_prompts  # the job refuses it with images
