"""Images in the embedded engine's /generate (issue 71): SGLang's request shape for a Qwen-VL style model.

A request sends `input_ids` with ONE ``<|image_pad|>`` per image and `image_data` (one entry per image: a
path, a data URL or a base64 string). As SGLang 0.5.23 does with SGLANG_MM_AVOID_RETOKENIZE (its default),
the sent ids are kept and each pad is expanded to the processor's count for its image
(`workers.vision`); the prompt then runs with the images' pixel values at 3-D (mrope) positions, and
decoding continues from the largest position + 1 (Qwen2-VL's rope delta), as SGLang computes them on the
server. `prompt_tokens` and the prompt's logprobs are over the expanded ids, and `image_tokens` counts the
pads, as SGLang reports them.

Where SGLang is lax the engine is strict (a 400 with SGLang's words): an image that cannot be read (SGLang:
400, or 500 for a missing file) and a pad count that differs from the images (SGLang drops extra images
with a warning, ignores images without pads, and never answers when images are fewer than pads).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import os
from typing import Any

import torch

from workers.engines.embedded.validation import BadRequest
from workers.vision import expand_image_pads, image_token_counts, load_images, padded_mrope_position_ids, vision_inputs


@dataclasses.dataclass(eq=False)
class VisionPrompt:
    """One prompt's images, ready for the prefill: its ids with expanded pads, pixel values, grids,
    3-D positions (``[3, L]``) and how far its text positions run ahead of its length."""

    ids: list[int]
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    positions: torch.Tensor
    rope_delta: int
    image_tokens: int
    key: str  # the images' identity: prompts share a prefill only with the same ids AND images


def load_model(model_path: str, dtype: torch.dtype):
    """The model at `model_path` and, for a vision-language one, its processor (else None): a config with a
    vision tower loads as an image-text-to-text model (all its weights, the vision tower's included)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "vision_config", None) is None:
        return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype), None
    from workers.vision import load_processor

    return AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype), load_processor(model_path)


def checkpoint_aliases(model) -> dict[str, str]:
    """The model's checkpoint names (what SGLang's loaders take: `visual.*`, `model.layers.*`) -> its own
    (transformers 5's `model.visual.*`, `model.language_model.*`), so a weight push under either name lands:
    the trainer's model names its parameters the second way, SGLang accepts only the first."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers before the conversion mappings: the names are the checkpoint's
        return {}
    own = model.state_dict()
    by_tensor = {id(tensor): name for name, tensor in own.items()}
    saved = revert_weight_conversion(model, dict(own))
    return {name: by_tensor[id(tensor)] for name, tensor in saved.items()
            if id(tensor) in by_tensor and by_tensor[id(tensor)] != name}


def _decoded(entry: Any, index: int):
    """An image_data entry as what `load_images` reads: a data URL or a path as it is, else base64 bytes."""
    if not isinstance(entry, str) or not entry:
        raise BadRequest(f"image_data[{index}] must be a path, a data URL or a base64 string, got {type(entry).__name__}")
    if entry.startswith("data:") or os.path.exists(entry) or os.sep in entry[:256]:
        return entry
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError):
        return entry  # neither: read as a path, which fails with the file's own error


def _load(entries: list[str]) -> list:
    images = []
    for index, entry in enumerate(entries):
        try:
            images += load_images([_decoded(entry, index)])
        except (ValueError, OSError) as error:  # SGLang's words (multimodal/processors/base_processor.py)
            shown = entry if len(entry) <= 80 else entry[:77] + "..."
            reason = str(error).partition("is not a readable image: ")[2] or str(error)
            raise BadRequest(f"An exception occurred while loading IMAGE data at index {index}: "
                             f"Error while loading data {shown}: {reason}") from None
    return images


def vision_prompt(model, processor, ids: list[int], entries: list[str]) -> VisionPrompt:
    """`ids` (one pad per image) and their images as the prefill runs them; a BadRequest for an unreadable
    image or a pad count that is not the image count."""
    config = model.config
    pad_id = int(config.image_token_id)
    pads = sum(1 for token in ids if token == pad_id)
    if pads != len(entries):  # SGLang's message (base_processor._expand_input_ids)
        raise BadRequest(f"prompt has {pads} image placeholder token(s) but {len(entries)} image(s) were provided")
    inputs = vision_inputs(processor, _load(entries))
    counts = image_token_counts(inputs["image_grid_thw"], config.vision_config.spatial_merge_size)
    expanded = expand_image_pads(ids, pad_id, counts)
    row = torch.tensor([expanded])
    positions = padded_mrope_position_ids(model, {"input_ids": row, "attention_mask": torch.ones_like(row)},
                                          inputs["image_grid_thw"])[:, 0]
    key = hashlib.sha256("\0".join(entries).encode()).hexdigest()
    return VisionPrompt(expanded, inputs["pixel_values"], inputs["image_grid_thw"], positions,
                        int(positions.max()) + 1 - len(expanded), sum(counts), key)


def prefill_inputs(visions: list[VisionPrompt | None], mask: torch.Tensor, positions: torch.Tensor,
                   dtype: torch.dtype) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """For left-padded rows (`mask`, 2-D text `positions`): their positions (``[3, b, W]`` when a row has
    images), the images' model inputs in row order (the order the model scatters them into the pads), and
    each row's first decode position (its length plus its rope delta)."""
    deltas = torch.tensor([v.rope_delta if v is not None else 0 for v in visions], dtype=torch.long)
    if all(v is None for v in visions):
        return positions, {}, deltas
    full = positions[None].repeat(3, 1, 1)
    for row, vision in enumerate(visions):
        if vision is not None:
            full[:, row, mask.shape[1] - len(vision.ids):] = vision.positions
    with_images = [v for v in visions if v is not None]
    extra = {"pixel_values": torch.cat([v.pixel_values for v in with_images]).to(dtype),
             "image_grid_thw": torch.cat([v.image_grid_thw for v in with_images])}
    return full, extra, deltas
