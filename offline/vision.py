"""Tiny random vision-language models (Qwen2.5-VL, Qwen3-VL) built from `transformers` configs with no
download, saved with a whole processor (the project's tiny tokenizer plus the vision special tokens, a chat
template that renders image parts, an image processor config): what the vision-language RL tests run the
trainer's forward and the engines on (issue 71).

Sizes: 2 text layers of hidden 64 (4 query heads of 16 over 2 key/value heads), a vision tower of depth 2 and
hidden 32, patches of 14 pixels (Qwen3-VL: 16) merged 2x2, and images resized to at most 56x56 pixels (64x64):
a 56x56 image is a 4x4 grid of patches, 4 merged tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)

# Image parts render as the engine sees them: one pad per image, between the vision markers (the processor
# expands the pad to the image's count of merged patches). Same turn layout as offline/arithmetic.py's template.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ '' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' }}"
    "{%- else -%}{{ 'Assistant: ' }}{%- endif -%}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part -%}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}{{ '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)

_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, max_position_embeddings=512, tie_word_embeddings=False)

# family: (config class, processor class, text-config extras, vision config, image patch size).
# mrope_section splits the 8 rotary frequencies of a 16-wide head among (time, height, width): Qwen2.5-VL takes
# them in blocks (they sum to 8), Qwen3-VL interleaves them (height and width every third one, so 3 x 2 + 2 <= 8).
FAMILIES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any], int]] = {
    "qwen2_5_vl": ("Qwen2_5_VLConfig", "Qwen2_5_VLProcessor",
                   dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
                   dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                        spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1]),
                   14),
    "qwen3_vl": ("Qwen3VLConfig", "Qwen3VLProcessor",
                 dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                       "mrope_interleaved": True}),
                 dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=16,
                      spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                      deepstack_visual_indexes=[0]),
                 16),
}
MERGE_SIZE = 2


def vision_tokenizer(tokenizer_dir: str | Path):
    """`tokenizer_dir`'s tokenizer with the vision special tokens added and the image-aware chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def vision_config(family: str, tokenizer, **text_overrides: Any):
    """A tiny `transformers` config of the vision-language `family` for `tokenizer` (from `vision_tokenizer`)."""
    import transformers

    if family not in FAMILIES:
        raise ValueError(f"unknown vision-language family {family!r}; choose one of {sorted(FAMILIES)}")
    class_name, _, text_extra, vision, _ = FAMILIES[family]
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in
           (("vision_start_token_id", VISION_START), ("vision_end_token_id", VISION_END),
            ("image_token_id", IMAGE_PAD), ("video_token_id", VIDEO_PAD))}
    text = dict(_TEXT, **text_extra, **text_overrides, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return getattr(transformers, class_name)(text_config=text, vision_config=dict(vision), tie_word_embeddings=False,
                                             **ids)


def image_processor_config(family: str) -> dict[str, Any]:
    """preprocessor_config.json of `family`'s tiny model: images resized to 1..4 merged tokens (at most 2x2)."""
    patch = FAMILIES[family][4]
    factor = patch * MERGE_SIZE
    return {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": FAMILIES[family][1],
            "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "do_convert_rgb": True, "patch_size": patch, "temporal_patch_size": 2, "merge_size": MERGE_SIZE,
            "min_pixels": factor * factor, "max_pixels": 4 * factor * factor,
            "size": {"shortest_edge": factor * factor, "longest_edge": 4 * factor * factor}}


def save_vision_model(family: str, tokenizer_dir: str | Path, out_dir: str | Path, seed: int = 0,
                      **text_overrides: Any) -> str:
    """A random vision-language `family` model saved to `out_dir` with its processor: the tokenizer of
    `tokenizer_dir` plus the vision tokens, the chat template, and the image (and video) processor configs:
    `AutoModelForImageTextToText` loads it, and `AutoProcessor` where torchvision is installed (the stock Qwen
    processors build a video processor); `workers.vision.load_processor` loads it anywhere."""
    import torch
    from transformers import AutoModelForImageTextToText

    out = Path(out_dir)
    tokenizer = vision_tokenizer(tokenizer_dir)
    config = vision_config(family, tokenizer, **text_overrides)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    # Written as files, not by the processor's save_pretrained: the stock processors need a video processor,
    # which needs torchvision, which the CPU build lacks (workers.vision.load_processor loads it without one).
    image = image_processor_config(family)
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2) + "\n")
    video = {**image, "video_processor_type": "Qwen2VLVideoProcessor" if family == "qwen2_5_vl" else
             "Qwen3VLVideoProcessor"}
    video.pop("image_processor_type")
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")
    (out / "processor_config.json").write_text(json.dumps({"processor_class": FAMILIES[family][1]}, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return str(out)


COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30), "yellow": (230, 220, 40)}


def write_colour_prompts(folder: str | Path, size: int = 56) -> str:
    """A prompt file of four rows, one solid-colour image each (written beside it, `size` pixels square), asking for
    the number of letters of the colour's name: the answer a numeric reward function scores. Returns its path."""
    import json

    from PIL import Image

    folder = Path(folder)
    rows = []
    for name, rgb in COLOURS.items():
        Image.new("RGB", (size, size), rgb).save(folder / f"{name}.png")
        rows.append({"messages": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "How many letters has the name of this colour?"}]}],
            "images": [f"{name}.png"], "answer": str(len(name))})
    path = folder / "colour_prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)
