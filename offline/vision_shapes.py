"""Offline assets of the vision GRPO recipe (configs/grpo_vision_shapes.yaml): synthetic pictures of coloured
shapes with questions about them, and a tiny Qwen2.5-VL policy that answers them, but not well (issue 71).

    vision-shapes/train.jsonl   {"messages": [user: image part + question], "images": ["data:image/png;..."],
                                 "answer": "3"} rows, the answer one word or one number
    vision-shapes/eval.jsonl    held-out rows: pictures drawn from another seed, none of them a training picture
    tiny-vision-shapes/         the policy with its processor, in Hugging Face format; build.json

A picture is 56x56 pixels (4 merged image tokens): 1 to 4 shapes of one kind (circle, square, triangle) and one
colour (red, blue, green, yellow), each in its own quadrant. The question asks how many there are or their colour
(the kind varies but is never asked: this tiny vision tower tells circles from squares only partly). The story is
the arithmetic recipe's: the policy is trained on the training pictures with the answers of an annotator who often
slips the same way (`SLIPS`: 3 shapes counted as 2, green called blue, ...). It learns to see (on a held-out picture
the true answer of a slipped kind gets probability 0.3-0.4, the slip the rest) but greedily reports the slip: held-out
greedy accuracy 0.375. GRPO with an exact-answer reward teaches it to say what it sees.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from offline.assets import (default_assets_root, ensure_tiny_assets, file_lock, settings_match, staged_directory,
                            torch_threads)

VISION_SHAPES = "tiny-vision-shapes"  # config value naming the recipe's policy and pictures

SIZE = 56  # pixels: a 4x4 grid of 14-pixel patches, 2x2 merged into 4 image tokens
COLOURS = {"red": (220, 40, 40), "blue": (40, 70, 220), "green": (40, 170, 60), "yellow": (235, 200, 30)}
KINDS = ("circle", "square", "triangle")
QUESTIONS = {"count": "How many shapes are there?", "colour": "What colour are the shapes?"}
# The annotator's systematic slips: the true answer (by question) and what is written instead, in `slip_frac`
# of the pretraining rows that have it. Each slip names a neighbour, never a pair swapped both ways: there GRPO
# found it easier to move both pictures to one answer than to tell them apart.
SLIPS = {"count": {"2": "1", "3": "2", "4": "3"}, "colour": {"green": "blue", "yellow": "red"}}


@dataclass(frozen=True)
class VisionShapesSettings:
    """Everything that determines the built assets; stored in build.json."""

    seed: int = 71
    train_rows: int = 3000
    eval_rows: int = 200
    slip_frac: float = 0.6
    # The policy: the text model's sizes (offline/vision.py's tiny Qwen2.5-VL, widened) and its vision tower's.
    hidden_size: int = 128
    num_attention_heads: int = 8
    intermediate_size: int = 256
    vision_hidden: int = 64
    vision_depth: int = 2
    # Its pretraining: a plain loop over the train rows with the slipped answers.
    steps: int = 600
    batch_size: int = 32
    lr: float = 1e-3  # at 3e-3 the image features grew large and alike, and the policy stopped looking


REAL_SETTINGS = VisionShapesSettings()
SMALL_SETTINGS = VisionShapesSettings(train_rows=64, eval_rows=16, hidden_size=64, num_attention_heads=4,
                                      intermediate_size=128, vision_hidden=32, steps=4, batch_size=8)


@dataclass(frozen=True)
class VisionShapesPaths:
    root: Path
    model_dir: Path
    data_dir: Path
    train_file: Path
    eval_file: Path

    @classmethod
    def under(cls, root: str | Path) -> "VisionShapesPaths":
        root = Path(root)
        data = root / "vision-shapes"
        return cls(root, root / VISION_SHAPES, data, data / "train.jsonl", data / "eval.jsonl")


# --- pictures and questions --------------------------------------------------------------------


def draw(count: int, colour: str, kind: str, rng: random.Random):
    """A SIZE x SIZE picture: `count` shapes of `kind` and `colour` in `count` different quadrants, each of a
    random size and place within its quadrant, on a light background."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (245, 245, 240))
    pen = ImageDraw.Draw(image)
    half = SIZE // 2
    for quadrant in rng.sample(range(4), count):
        side = rng.randint(14, 22)
        x = (quadrant % 2) * half + rng.randint(2, half - side - 2)
        y = (quadrant // 2) * half + rng.randint(2, half - side - 2)
        fill = COLOURS[colour]
        if kind == "circle":
            pen.ellipse((x, y, x + side, y + side), fill=fill)
        elif kind == "square":
            pen.rectangle((x, y, x + side, y + side), fill=fill)
        else:
            pen.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=fill)
    return image


def make_rows(count: int, seed: int) -> list[dict]:
    """`count` rows: a picture, one question about it, its answer (and the picture's facts, `shapes`)."""
    from workers.vision import data_url

    rng = random.Random(f"vision-shapes:{seed}")
    rows = []
    for _ in range(count):
        facts = {"count": str(rng.randint(1, 4)), "colour": rng.choice(sorted(COLOURS)), "kind": rng.choice(KINDS)}
        image = draw(int(facts["count"]), facts["colour"], facts["kind"], rng)
        question = rng.choice(sorted(QUESTIONS))
        rows.append({"messages": [{"role": "user", "content": [{"type": "image"},
                                                               {"type": "text", "text": QUESTIONS[question]}]}],
                     "images": [data_url(image)], "answer": facts[question], "question": question, "shapes": facts})
    return rows


def make_splits(settings: VisionShapesSettings) -> dict[str, list[dict]]:
    """The train rows and the held-out rows, whose pictures are none of the training pictures (a held-out
    picture drawn the same, pixel for pixel, as a training one is drawn again from the seed's stream)."""
    train = make_rows(settings.train_rows, settings.seed)
    seen = {row["images"][0] for row in train}
    held_out: list[dict] = []
    extra = 0
    while len(held_out) < settings.eval_rows:
        batch = make_rows(settings.eval_rows + extra, settings.seed + 1)
        held_out = [row for row in batch if row["images"][0] not in seen][:settings.eval_rows]
        extra += settings.eval_rows - len(held_out)
    return {"train.jsonl": train, "eval.jsonl": held_out}


def slipped(row: dict, rng: random.Random, slip_frac: float) -> str:
    """The answer the careless annotator wrote for `row`."""
    slip = SLIPS[row["question"]].get(row["answer"])
    return slip if slip is not None and rng.random() < slip_frac else row["answer"]


# --- the policy ---------------------------------------------------------------------------------


def _encode(rows: list[dict], answers: list[str], tokenizer, processor):
    """Each row as the trainer sees it (prompt ids with the processor's expanded image pads, the answer's ids and
    EOS after them, the loss on those only), padded into one batch with its images."""
    import torch

    from workers.vision import expand_image_pads, image_token_counts, vision_inputs

    pad_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    images = vision_inputs(processor, [row["images"][0] for row in rows])
    counts = image_token_counts(images["image_grid_thw"], processor.image_processor.merge_size)
    sequences, targets = [], []
    for row, answer, n in zip(rows, answers, counts):
        prompt = tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=True)
        prompt = expand_image_pads(list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt), pad_id, [n])
        response = tokenizer(" " + answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        sequences.append(prompt + response)
        targets.append([-100] * len(prompt) + response)
    width = max(map(len, sequences))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (sequence, target) in enumerate(zip(sequences, targets)):
        ids[i, :len(sequence)], labels[i, :len(target)], mask[i, :len(sequence)] = \
            torch.tensor(sequence), torch.tensor(target), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **images}


def _pretrain(settings: VisionShapesSettings, tokenizer_dir: Path, train: list[dict], out_dir: Path,
              log: Callable[[str], None]) -> dict:
    """The tiny Qwen2.5-VL built and trained on `train`'s pictures with the annotator's answers, saved to `out_dir`
    with its processor. A plain torch loop: the SFT job has no image path (its rows are text)."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from offline.vision import save_vision_model
    from workers.vision import load_processor

    # The processor, tokenizer and a random model of offline/vision.py's sizes first; the model is then made
    # again at this recipe's sizes (its vision tower wider than vision_config's), trained and saved over it.
    save_vision_model("qwen2_5_vl", tokenizer_dir, out_dir, seed=settings.seed, hidden_size=settings.hidden_size,
                      num_attention_heads=settings.num_attention_heads, intermediate_size=settings.intermediate_size)
    config = AutoConfig.from_pretrained(out_dir)
    vision = config.vision_config
    vision.hidden_size, vision.depth, vision.intermediate_size = settings.vision_hidden, settings.vision_depth, \
        2 * settings.vision_hidden
    vision.out_hidden_size = settings.hidden_size
    tokenizer, processor = AutoTokenizer.from_pretrained(out_dir), load_processor(out_dir)
    torch.manual_seed(settings.seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / settings.steps)
    rng = random.Random(settings.seed)
    answers = [slipped(row, rng, settings.slip_frac) for row in train]
    order: list[int] = []
    losses = []
    model.train()
    for step in range(settings.steps):
        if len(order) < settings.batch_size:
            order += rng.sample(range(len(train)), len(train))
        chosen, order = order[:settings.batch_size], order[settings.batch_size:]
        batch = _encode([train[i] for i in chosen], [answers[i] for i in chosen], tokenizer, processor)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % max(1, settings.steps // 10) == 0:
            log(f"[offline] vision-shapes policy: step {step + 1}/{settings.steps} loss {losses[-1]:.3f}")
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    tail = losses[-max(1, len(losses) // 10):]
    return {"parameters": sum(p.numel() for p in model.parameters()), "first_loss": losses[0],
            "final_loss": sum(tail) / len(tail)}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({key: row[key] for key in ("messages", "images", "answer")}) + "\n")


def ensure_vision_shapes_assets(root: str | Path | None = None, *, small: bool = False,
                                log: Callable[[str], None] = print) -> VisionShapesPaths:
    """Build the recipe's pictures and policy if missing or stale; return where they are. Safe from every rank
    at once (file lock); the first build takes about a minute on 2 cores, later calls return at once."""
    settings = SMALL_SETTINGS if small else REAL_SETTINGS
    paths = VisionShapesPaths.under(Path(root) if root is not None else default_assets_root())
    expected = json.loads(json.dumps({"component": VISION_SHAPES, "small": small, **dataclasses.asdict(settings),
                                      "slips": SLIPS}))
    if settings_match(paths.model_dir / "build.json", expected) and settings_match(paths.data_dir / "build.json",
                                                                                   expected):
        return paths
    base = ensure_tiny_assets(paths.root, small=small, log=log)  # the tokenizer the policy's is made from
    with file_lock(paths.root / f".{VISION_SHAPES}.lock"):
        splits = make_splits(settings)
        if not settings_match(paths.data_dir / "build.json", expected):
            log(f"[offline] writing the vision-shapes pictures under {paths.data_dir}")
            with staged_directory(paths.data_dir) as staging:
                for name, rows in splits.items():
                    _write_jsonl(staging / name, rows)
                (staging / "build.json").write_text(json.dumps({"settings": expected}, indent=2))
        if not settings_match(paths.model_dir / "build.json", expected):
            started = time.perf_counter()
            log(f"[offline] training the vision-shapes policy under {paths.model_dir}; cached for later runs")
            with staged_directory(paths.model_dir) as staging, torch_threads(1):  # one thread: the same bits anywhere
                facts = _pretrain(settings, base.model_dir, splits["train.jsonl"], staging, log)
                facts["seconds"] = round(time.perf_counter() - started, 1)
                (staging / "build.json").write_text(json.dumps({"settings": expected, **facts}, indent=2))
    return paths
