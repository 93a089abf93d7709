"""Images in the trainer's micro-batches (vision-language RL, issue 71): what the data path, the trainer and
the engines share about a Qwen2.5-VL / Qwen3-VL style model.

Conventions:

- Token ids. The engine is sent ONE ``<|image_pad|>`` per image (SGLang's convention: it expands the pad
  itself); the trainer trains on the expanded ids, as many pads per image as the processor makes
  (`image_token_counts`, `expand_image_pads`; `collapse_image_pads` is the way back).
- Images of a micro-batch. ``pixel_values`` and ``image_grid_thw`` hold every image of the micro-batch in the
  order its pads appear in the padded rows (row by row, left to right): the concatenation of each sequence's
  own processor output. `with_vision` adds them, with the 3-D rotary positions, to a `rows_to_batch`
  micro-batch; `workers.layout.pack` keeps them, and `vision_model_inputs` (called by
  `workers.forward`) gives the model its images in the order of the layout it runs on, padded or packed.
"""

from __future__ import annotations

import base64
import inspect
import io
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence, Union

import torch

from workers.engines.weights import Probe
from workers.layout import host_view

if TYPE_CHECKING:
    from PIL import Image

ImageLike = Union[str, Path, bytes, "Image.Image"]  # PIL is imported where images are read

# What `with_vision` adds to a micro-batch: not `[b, T]` rows (whatever splits or balances rows must carry them).
VISION_KEYS = ("pixel_values", "image_grid_thw", "mrope_position_ids", "image_token_start")


# --------------------------------------------------------------------------- processor and images


def load_processor(path: str | Path):
    """The model's processor (`AutoProcessor`). Qwen's processors also build a video processor, which needs
    torchvision; where torchvision is missing (the CPU build), the same processor class without one: images
    and text work alike, videos do not."""
    import json

    import transformers
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(str(path))
    except ImportError as error:
        if "torchvision" not in str(error).lower():
            raise
    name = json.loads((Path(path) / "processor_config.json").read_text())["processor_class"]
    stock = getattr(transformers, name)
    # The stock constructor checks each part's class; the video processor's base class is what torchvision's
    # absence removes, so a missing (None) video processor passes unchecked.
    without_video = type(f"{name}WithoutVideo", (stock,), {
        "check_argument_for_proper_class": lambda self, attribute, argument:
            None if argument is None else stock.check_argument_for_proper_class(self, attribute, argument)})
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return without_video(image_processor=AutoImageProcessor.from_pretrained(str(path)), tokenizer=tokenizer,
                         video_processor=None, chat_template=tokenizer.chat_template)


def _open_image(image: Any, name: str):
    from PIL import Image

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (bytes, bytearray)):
        source = io.BytesIO(image)
    elif isinstance(image, str) and image.startswith("data:image"):  # an OpenAI-style data URL
        source = io.BytesIO(base64.b64decode(image.partition(",")[2]))
    elif isinstance(image, (str, Path)):
        source = Path(image)
    else:
        raise ValueError(f"{name} is a {type(image).__name__}; an image is a path, bytes or a PIL image")
    try:
        with Image.open(source) as opened:
            return opened.convert("RGB")  # reads it whole: a truncated file fails here, not in the processor
    except (OSError, ValueError, SyntaxError) as error:  # PIL's UnidentifiedImageError is an OSError
        raise ValueError(f"{name} is not a readable image: {error}") from None


def load_images(images: ImageLike | Sequence[ImageLike]) -> list:
    """`images` (one or a list: paths, data URLs, encoded bytes or PIL images) as RGB PIL images; an unreadable
    one raises a ValueError naming it."""
    if not isinstance(images, (list, tuple)):
        images = [images]
    opened = []
    for i, image in enumerate(images):
        if isinstance(image, (bytes, bytearray)):
            name = f"image {i} ({len(image)} bytes)"
        elif isinstance(image, str) and image.startswith("data:"):
            name = f"image {i} (a data URL)"
        elif isinstance(image, (str, Path)):
            name = f"image {i} ({str(image)!r})"
        else:
            name = f"image {i}"
        opened.append(_open_image(image, name))
    return opened


def vision_inputs(processor, images: Sequence[ImageLike]) -> dict[str, torch.Tensor]:
    """``pixel_values`` (``[patches, C*t*p*p]``) and ``image_grid_thw`` (``[images, 3]``) of `images` by the
    model's own image processor (`processor`: its `load_processor`, or the image processor itself)."""
    image_processor = getattr(processor, "image_processor", processor)
    if not images:
        return {"pixel_values": torch.zeros(0, 0), "image_grid_thw": torch.zeros(0, 3, dtype=torch.long)}
    out = image_processor(images=load_images(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"].long()}


# --------------------------------------------------------------------------- image pads


def image_token_counts(grid_thw: torch.Tensor | Sequence[Sequence[int]], merge_size: int) -> list[int]:
    """Pads per image: its patches (t x h x w of `grid_thw`) over the `merge_size` x `merge_size` merge."""
    counts = []
    for t, h, w in torch.as_tensor(grid_thw).reshape(-1, 3).tolist():
        if h % merge_size or w % merge_size:
            raise ValueError(f"image grid {(t, h, w)} is not a multiple of the merge size {merge_size}")
        counts.append(t * h * w // merge_size ** 2)
    return counts


def expand_image_pads(ids: Sequence[int], image_pad_id: int, counts: Sequence[int]) -> list[int]:
    """`ids` with one `image_pad_id` per image (what the engine is sent) made the trainer's ids: image i's pad
    repeated `counts[i]` times (`image_token_counts`)."""
    singles = sum(1 for token in ids if token == image_pad_id)
    if singles != len(counts):
        raise ValueError(f"the token ids hold {singles} image pad tokens (id {image_pad_id}) for {len(counts)} images; "
                         "the engine's ids carry exactly one pad per image")
    expanded: list[int] = []
    images = iter(counts)
    for token in ids:
        expanded.extend([token] * next(images) if token == image_pad_id else [token])
    return expanded


def collapse_image_pads(ids: Sequence[int], image_pad_id: int) -> list[int]:
    """The way back from `expand_image_pads`: each run of pads one pad (the ids an engine is sent)."""
    return [token for i, token in enumerate(ids) if token != image_pad_id or i == 0 or ids[i - 1] != image_pad_id]


def data_url(image: "Image.Image") -> str:
    """An RGB PIL image as a PNG data URL (SGLang's image_data takes it; a path would have to exist where
    the engine runs)."""
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def vision_probe(processor, tokenizer, text_ids: Sequence[int]) -> Probe:
    """The weight probe of a vision-language policy: one fixed picture (every channel varying, 56 pixels square)
    between the vision markers, then the probe's text, so the check after each push runs the vision tower too."""
    from PIL import Image

    gradient = Image.linear_gradient("L").resize((56, 56))
    picture = Image.merge("RGB", (gradient, gradient.rotate(90), gradient.transpose(Image.Transpose.FLIP_LEFT_RIGHT)))
    pad = getattr(processor, "image_token_id", None)
    pad = int(pad) if pad is not None else int(tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    start, end = (int(tokenizer.convert_tokens_to_ids(token)) for token in ("<|vision_start|>", "<|vision_end|>"))
    engine_ids = [start, pad, end, *map(int, text_ids)]
    images = vision_inputs(processor, [picture])
    counts = image_token_counts(images["image_grid_thw"], getattr(processor, "image_processor", processor).merge_size)
    return Probe(expand_image_pads(engine_ids, pad, counts), engine_ids, [data_url(picture)], images, pad)


# --------------------------------------------------------------------------- 3-D rotary positions


def _rope_owner(model):
    """The module holding `get_rope_index` (Qwen*VLModel), under peft's or FSDP's wrappers too."""
    for module in model.modules():
        if hasattr(module, "get_rope_index") and hasattr(module, "config"):
            return module
    raise ValueError(f"{type(model).__name__} has no get_rope_index: not a Qwen-VL style model with 3-D rotary positions")


def _image_runs(batch: dict[str, torch.Tensor], image_pad_id: int) -> list[list[tuple[int, int]]]:
    """Per padded row, each image's pad run among the row's real tokens: (column of its first pad, its length)."""
    host = host_view(batch)
    runs = []
    for ids, real in zip(host["input_ids"], host["attention_mask"].bool()):
        columns = real.nonzero().squeeze(1)
        pad = (ids[columns] == image_pad_id).long()
        edges = torch.diff(pad, prepend=pad.new_zeros(1), append=pad.new_zeros(1))
        starts, stops = (edges == 1).nonzero().squeeze(1), (edges == -1).nonzero().squeeze(1)
        runs.append([(int(columns[a]), int(b - a)) for a, b in zip(starts, stops)])
    return runs


def padded_mrope_position_ids(model, batch: dict[str, torch.Tensor], image_grid_thw: torch.Tensor) -> torch.Tensor:
    """``[3, b, T]`` rotary positions (time, height, width) of the padded rows, each sequence's by the model's own
    `get_rope_index` on its real tokens (padding anywhere in a row: 0 there), its images taken in order from
    `image_grid_thw`."""
    owner = _rope_owner(model)
    config = owner.config
    image_pad_id, merge = config.image_token_id, config.vision_config.spatial_merge_size
    host = host_view(batch)
    grids = torch.as_tensor(image_grid_thw).reshape(-1, 3).cpu().long()
    runs = _image_runs(batch, image_pad_id)
    if sum(map(len, runs)) != len(grids):
        raise ValueError(f"the micro-batch's rows hold {sum(map(len, runs))} images (runs of image pads) but "
                         f"image_grid_thw has {len(grids)}")
    positions = torch.zeros(3, *host["input_ids"].shape, dtype=torch.long)
    parameters = inspect.signature(owner.get_rope_index).parameters
    first = 0
    for row, row_runs in enumerate(runs):
        row_grids = grids[first:first + len(row_runs)]
        first += len(row_runs)
        for (column, length), count in zip(row_runs, image_token_counts(row_grids, merge)):
            if length != count:
                raise ValueError(f"row {row}: the image at column {column} has {length} pads but its grid "
                                 f"makes {count}; expand the engine's ids with expand_image_pads")
        real = host["attention_mask"][row].bool()
        ids = host["input_ids"][row][real][None]
        # older transformers versions find the images from the ids alone (no mm_token_type_ids argument)
        types = {"mm_token_type_ids": (ids == image_pad_id).int()} if "mm_token_type_ids" in parameters else {}
        with torch.no_grad():
            row_positions, _ = owner.get_rope_index(input_ids=ids, image_grid_thw=row_grids if len(row_grids) else None,
                                                    **types)
        positions[:, row, real] = row_positions[:, 0]
    return positions


def _packed_positions(batch: dict[str, torch.Tensor], padded: torch.Tensor) -> torch.Tensor:
    """Padded rows' ``[3, b, T]`` positions moved to the packed rows (``[3, n, L]``) through `packed_index`:
    each packed sequence keeps its own positions, restarted per sequence."""
    host = host_view(batch)
    rows, columns = host["attention_mask"].bool().nonzero(as_tuple=True)
    where = host["packed_index"][rows, columns]
    device = batch["packed_input_ids"].device
    packed = torch.zeros(3, *batch["packed_input_ids"].shape, dtype=torch.long, device=device)
    packed.view(3, -1)[:, where.to(device)] = padded.to(device)[:, rows.to(device), columns.to(device)]
    return packed


def mrope_position_ids(model, batch: dict[str, torch.Tensor], image_grid_thw: torch.Tensor) -> torch.Tensor:
    """The 3-D rotary positions of the layout `batch` runs on: ``[3, b, T]`` for padded rows (left, right or any
    padding, read from its attention_mask), ``[3, n, L]`` for the packed rows of `workers.layout.pack`."""
    padded = padded_mrope_position_ids(model, batch, image_grid_thw)
    return _packed_positions(batch, padded) if "packed_index" in batch else padded


def with_vision(batch: dict[str, torch.Tensor], model, pixel_values: torch.Tensor,
                image_grid_thw: torch.Tensor) -> dict[str, torch.Tensor]:
    """`batch` (right after `rows_to_batch`, before `pack`; ids with expanded pads) with its images: every
    image of the micro-batch in the order of its pads (row by row), their padded 3-D positions, and where each
    image's first pad is (flat index into the padded rows), which `vision_model_inputs` reorders images by."""
    if "packed_index" in batch:
        raise ValueError("with_vision takes the padded micro-batch; pack it afterwards")
    grids = torch.as_tensor(image_grid_thw).reshape(-1, 3).long()
    positions = padded_mrope_position_ids(model, batch, grids)
    width = batch["input_ids"].shape[1]
    runs = _image_runs(batch, _rope_owner(model).config.image_token_id)
    starts = torch.tensor([row * width + column for row, row_runs in enumerate(runs) for column, _ in row_runs],
                          dtype=torch.long)
    return {**batch, "pixel_values": pixel_values, "image_grid_thw": grids, "mrope_position_ids": positions,
            "image_token_start": starts}


def _packed_image_order(batch: dict[str, torch.Tensor]) -> list[int]:
    """The micro-batch's images in the order their pads take in the packed rows; an image of a shared prompt
    (`pack(share_prompts=True)`) once."""
    host = host_view(batch)
    where = host["packed_index"].reshape(-1)[host["image_token_start"]].tolist()
    order, seen = [], {}
    for image in sorted(range(len(where)), key=where.__getitem__):
        if where[image] in seen:
            kept = seen[where[image]]
            if not (torch.equal(host["image_grid_thw"][kept], host["image_grid_thw"][image])
                    and torch.equal(_patches(batch, kept), _patches(batch, image))):
                raise ValueError("rows packed as sharing a prompt show different images under the same pads; "
                                 "pack this micro-batch without share_prompts")
            continue
        seen[where[image]] = image
        order.append(image)
    return order


def _patch_offsets(grids: torch.Tensor) -> list[int]:
    return [0] + torch.cumsum(grids.prod(-1), 0).tolist()


def _patches(batch: dict[str, torch.Tensor], image: int) -> torch.Tensor:
    offsets = _patch_offsets(host_view(batch)["image_grid_thw"])
    return batch["pixel_values"][offsets[image]:offsets[image + 1]]


def vision_model_inputs(batch: dict[str, torch.Tensor], inputs: dict[str, Any],
                        sequence_parallel: bool = False) -> dict[str, Any]:
    """`inputs` (`workers.layout.model_inputs` of `batch`) with the images and 3-D positions of the layout the
    model runs on: padded rows as `with_vision` made them; packed rows with the images reordered to where their
    pads went, and positions moved along (the one-row layout also gets the text positions in front, ``[4, 1, L]``,
    from which transformers finds where each sequence starts)."""
    if sequence_parallel:
        raise ValueError("sequence parallelism does not split vision-language micro-batches yet (issue 71)")
    grids = batch["image_grid_thw"]
    if "packed_index" not in batch:
        images = {"pixel_values": batch["pixel_values"], "image_grid_thw": grids} if len(grids) else {}
        return {**inputs, **images, "position_ids": batch["mrope_position_ids"].to(batch["input_ids"].device)}
    positions = _packed_positions(batch, batch["mrope_position_ids"])
    if "packed_one_row" in batch:
        positions = torch.cat([batch["packed_position_ids"][None].to(positions.device), positions])
    if not len(grids):
        return {**inputs, "position_ids": positions}
    order = _packed_image_order(batch)
    offsets = _patch_offsets(host_view(batch)["image_grid_thw"])
    patches = torch.cat([torch.arange(offsets[i], offsets[i + 1]) for i in order])
    device = batch["pixel_values"].device
    return {**inputs, "position_ids": positions, "pixel_values": batch["pixel_values"][patches.to(device)],
            "image_grid_thw": grids[torch.tensor(order).to(grids.device)]}


# --------------------------------------------------------------------------- images of a step's rows


# A step batch (every row of a PPO step) with images holds them whole, not as `[N, T]` rows: every image of every
# row, row by row, and the row each image belongs to. Row selections (a minibatch, a micro-batch) go through
# `rows_images`, never `value[index]`; `with_vision` turns a micro-batch's share into `VISION_KEYS`.
STEP_IMAGE_KEYS = ("pixel_values", "image_grid_thw", "image_rows")


def step_images(per_row: Sequence[tuple[torch.Tensor, torch.Tensor] | None]) -> dict[str, torch.Tensor]:
    """The `STEP_IMAGE_KEYS` of a batch whose row i shows `per_row[i]` (its `vision_inputs`: pixel values and
    grids), or nothing (None)."""
    shown = [(row, pixels, torch.as_tensor(grids).reshape(-1, 3).long())
             for row, inputs in enumerate(per_row) if inputs is not None for pixels, grids in [inputs]]
    if not shown:
        raise ValueError("step_images got no row with images; a text-only batch has no image keys")
    return {"pixel_values": torch.cat([pixels for _, pixels, _ in shown]),
            "image_grid_thw": torch.cat([grids for _, _, grids in shown]),
            "image_rows": torch.cat([torch.full((len(grids),), row, dtype=torch.long) for row, _, grids in shown])}


def rows_images(batch: dict[str, torch.Tensor], indices: Sequence[int]) -> dict[str, torch.Tensor]:
    """The `STEP_IMAGE_KEYS` of rows `indices` of `batch` (in that order, renumbered 0..): each row's images in
    their own order, as its pads appear."""
    rows, grids = batch["image_rows"].tolist(), batch["image_grid_thw"]
    offsets = _patch_offsets(grids)
    by_row: dict[int, list[int]] = {}
    for image, row in enumerate(rows):
        by_row.setdefault(row, []).append(image)
    images = [image for row in indices for image in by_row.get(row, [])]
    new_row = {row: i for i, row in enumerate(indices)}
    patches = [torch.arange(offsets[image], offsets[image + 1]) for image in images]
    return {"pixel_values": batch["pixel_values"][torch.cat(patches) if patches else torch.zeros(0, dtype=torch.long)],
            "image_grid_thw": grids[torch.tensor(images, dtype=torch.long)],
            "image_rows": torch.tensor([new_row[rows[image]] for image in images], dtype=torch.long)}
