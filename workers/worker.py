"""One rank's path from a step's batch to its models, the same for every job (PPO, SFT, DPO, reward model).

A job builds one tensor batch per step (`layout.rows_to_batch` of all its rows: `[N, T]` token
tensors, any `[N]` per-row tensors) that every rank holds whole. The worker then:

1. balances rows across ranks by tokens and cuts this rank's share into length-sorted micro-batches,
   the same count on every rank (`workers.balance`); rows that must stay together (a DPO pair, a
   reward-model comparison, with `share_prompts` a group's responses to one prompt) are one unit;
2. selects each micro-batch from the batch by index (no re-collation), trims it to its longest row
   and lays it out (padded rows, or packed: `layout.laid_out`), on the rank's device;
3. runs a stand-in (row 0, weight 0) where a rank has fewer units than micro-batches, since FSDP's
   forwards are collectives;
4. applies the loss scaling rule, here and nowhere else: each rank sums its losses, divides by the
   *global* count and multiplies by the number of ranks, because FSDP averages gradients over them; the
   accumulated gradient then equals the single-process gradient of the global mean.

With sequence parallelism (`workers.sequence_parallel`) the rows are balanced over the data-parallel
groups; the ranks of a sequence group run the same micro-batches, each on 1/N of their tokens, so a
micro-batch holds up to N x `max_tokens`.

A job supplies only its loss (`loss_fn(model, micro_batch) -> (summed loss, metrics)`) or, forward
only, what to compute (`compute_and_share`, `sums`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from workers.balance import micro_batches_for_rank, with_stand_ins
from workers.forward import ForwardSettings, MicroBatch
from workers.layout import laid_out, packing_layout, prompt_groups, to_device
from workers.vision import STEP_IMAGE_KEYS, rows_images, with_vision

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, dict[str, float]]]


class BatchWorker:
    """Micro-batches of one rank: `max_tokens` bounds each one's padded size (packed: its real tokens) per
    device; `layout` is `layout.packing_layout`'s; `share_prompts` packs a group's prompt once; `settings`
    say how models run on the micro-batches (LM-head chunks, the sequence-parallel group). A batch with images
    (`workers.vision.STEP_IMAGE_KEYS`) needs `vision_model`, any model of the vision-language family (its config
    gives the 3-D rotary positions of `workers.vision.with_vision`)."""

    def __init__(self, rank: int, world_size: int, device: torch.device, max_tokens: int,
                 layout: str | None = None, share_prompts: bool = False, settings: ForwardSettings | None = None,
                 vision_model: torch.nn.Module | None = None):
        if share_prompts and layout != "rows":
            raise ValueError("share_prompts needs packed rows with a mask (packing on, a non-flash attention kernel)")
        self.settings = settings or ForwardSettings()
        group = self.settings.sequence
        if group is not None and layout != "rows":
            raise ValueError("model.sequence_parallel > 1 splits packed rows: turn packing on (the job's `packing` "
                             "key) and use an sdpa or eager attention kernel")
        self.rank, self.world_size, self.device = rank, world_size, device
        # Balancing is over data-parallel groups: a sequence group's ranks share their micro-batches.
        self.dp_rank, self.dp_size = (rank, world_size) if group is None else (group.dp_rank, group.dp_size)
        self.sp_size = 1 if group is None else group.size
        self.owner = group is None or group.rank == 0  # the rank of its group that reports forward-only results
        self.max_tokens = max_tokens * self.sp_size
        self.layout, self.share_prompts = layout, share_prompts
        self.vision_model = vision_model

    # ------------------------------------------------------------------ planning


    @classmethod
    def for_job(cls, run, rank: int, world_size: int, device: torch.device, max_tokens: int, packing: bool,
                share_prompts: bool = False, vision_model: torch.nn.Module | None = None) -> "BatchWorker":
        """Every job's worker: its `model` run keys (`rl_core.config.ModelRunConfig`: the attention kernel that
        decides the packed layout, sequence parallelism, logits chunks) and its packing key."""
        return cls(rank, world_size, device, max_tokens, packing_layout(packing, run.attn_implementation),
                   share_prompts, ForwardSettings.for_job(run, world_size, device), vision_model)

    def plan(self, batch: Batch, units: list[list[int]] | None = None) -> list[tuple[list[int], bool]]:
        """This rank's micro-batches as `(row indices, real)`; `units` (default: each row alone) stay whole."""
        lengths = row_lengths(batch["attention_mask"], real_only=self.layout is not None)
        if self.share_prompts:
            unit_rows, unit_tokens = shared_prompt_units(batch, units, self.max_tokens)
        elif units is None:
            unit_rows, unit_tokens = [[row] for row in range(len(lengths))], lengths.tolist()
        else:  # packed, a unit costs its real tokens; padded, its rows x its longest row
            unit_rows = units
            unit_tokens = [int(lengths[unit].sum()) if self.layout is not None else len(unit) * int(lengths[unit].max())
                           for unit in units]
        too_long = max(unit_tokens)
        if too_long > self.max_tokens:
            raise ValueError(f"one micro-batch must hold {too_long} tokens (a sequence, or rows that stay together) "
                             f"but max_tokens_per_device={self.max_tokens}; raise it or shorten the data")
        mine = micro_batches_for_rank(unit_tokens, self.dp_rank, self.dp_size, self.max_tokens,
                                      packed=self.layout is not None)
        return [(indices, real) for indices, real in
                with_stand_ins([[row for unit in batch_units for row in unit_rows[unit]] for batch_units in mine])]

    def micro_batch(self, batch: Batch, indices: list[int]) -> Batch:
        """Rows `indices` of `batch`, trimmed to their longest, laid out, on this rank's device."""
        index = torch.tensor(indices)
        width = int(row_lengths(batch["attention_mask"][index], real_only=False).max())
        rows = {key: select(value, index, width) for key, value in batch.items() if key not in STEP_IMAGE_KEYS}
        if "image_rows" in batch:  # the rows' own images, in row order, before packing moves them
            if self.vision_model is None:
                raise ValueError("the batch carries images but the worker has no vision_model for their 3-D positions")
            images = rows_images(batch, indices)
            rows = with_vision(rows, self.vision_model, images["pixel_values"], images["image_grid_thw"])
        micro = laid_out(rows, self.layout, share_prompts=self.share_prompts, multiple=self.sp_size)
        return MicroBatch(to_device(micro, self.device), self.settings, host=micro)

    def micro_batches(self, batch: Batch, units: list[list[int]] | None = None) -> list[tuple[Batch, bool]]:
        """This rank's micro-batches of `batch` as `(micro-batch, real)`, the same count on every rank (checked:
        each forward and backward is a collective)."""
        micro_batches = [(self.micro_batch(batch, indices), real) for indices, real in self.plan(batch, units)]
        check_same_count_on_all_ranks(len(micro_batches), self.world_size, self.device)
        return micro_batches

    # ------------------------------------------------------------------ forward only

    @torch.no_grad()
    def compute_and_share(self, batch: Batch, fn: Callable[[Batch], tuple[torch.Tensor, ...]],
               units: list[list[int]] | None = None) -> list[torch.Tensor]:
        """`fn(micro_batch)` over this rank's share; every rank gets every row's outputs.

        `fn` returns `[b, T]` (per token) or `[b]` (per row) tensors; the result holds one `[N, T]` or
        `[N]` float tensor per output, on the CPU. Each row is computed by exactly one rank into
        zero-filled buffers (by one rank of its sequence group), so one sum over ranks gathers them (no pickling)."""
        n, width = batch["input_ids"].shape
        outputs: list[torch.Tensor] | None = None
        for indices, real in self.plan(batch, units):
            results = fn(self.micro_batch(batch, indices))
            if outputs is None:
                outputs = [torch.zeros((n, width) if r.dim() == 2 else (n,), device=self.device) for r in results]
            if real and self.owner:
                index = torch.tensor(indices, device=self.device)
                for out, result in zip(outputs, results):
                    if result.dim() == 2:
                        out[index, :result.shape[1]] = result.float()
                    else:
                        out[index] = result.float()
        # One buffer, one all-reduce and one device-to-host copy for all outputs: each copy waits for the device.
        flat = torch.cat([out.flatten() for out in outputs])
        self.all_reduce(flat)
        return [part.view(out.shape) for part, out in zip(flat.cpu().split([out.numel() for out in outputs]), outputs)]

    @torch.no_grad()
    def sums(self, batch: Batch, fn: Callable[[Batch], list[float]], units: list[list[int]] | None = None) -> list[float]:
        """`fn(micro_batch)`'s numbers summed over the real micro-batches of every rank (held-out metrics)."""
        totals: list[float] | None = None
        for micro, real in self.micro_batches(batch, units):
            values = fn(micro)
            totals = totals or [0.0] * len(values)
            if real:
                totals = [total + float(value) for total, value in zip(totals, values)]
        return self.sum_over_ranks(totals)

    # ------------------------------------------------------------------ training

    def scaled_loss(self, loss_sum: torch.Tensor, global_count: float,
                    real: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss scaling rule (module docstring) on one micro-batch's summed loss: what to run `backward` on (0 x
        the loss for a stand-in), and this rank's share of the batch's loss, detached (the mean over ranks is the
        batch's loss; a sequence group's ranks share one)."""
        scaled = scale_loss(loss_sum, global_count, self.world_size) * float(real)
        return scaled, scaled.detach() / self.sp_size

    def forward_backward(self, trainable, batch: Batch, loss_fn: LossFn, global_count: float,
                         units: list[list[int]] | None = None) -> tuple[dict[str, list], list[Batch]]:
        """Accumulate `trainable`'s gradients over this rank's micro-batches of `batch` (the fine-tuning jobs'
        loop; PPO's `train_minibatch` runs its own for two models).

        `loss_fn(model, micro_batch)` returns the micro-batch's loss *summed* (over tokens, rows or
        pairs: whatever `global_count` counts over the whole batch) and its metrics. Returns the metrics of the
        real micro-batches (one entry each, tensors unread: `workers.read_back.read_back`; `loss` is this rank's
        share of the scaled loss) and the micro-batches run."""
        micro_batches = self.micro_batches(batch, units)
        trainable.model.train()
        metrics: dict[str, list] = {}
        for micro_batch, real in micro_batches:
            loss, micro_metrics = loss_fn(trainable.model, micro_batch)
            if "loss" in micro_metrics:
                raise ValueError(f"loss_fn's metrics {sorted(micro_metrics)} use the key the worker sets ('loss'); "
                                 "rename it")
            scaled, micro_metrics["loss"] = self.scaled_loss(loss, global_count, real)
            scaled.backward()
            if real:
                for key, value in micro_metrics.items():
                    metrics.setdefault(key, []).append(value.detach() if isinstance(value, torch.Tensor) else value)
        return metrics, [micro_batch for micro_batch, real in micro_batches if real]

    # ------------------------------------------------------------------ collectives

    def all_reduce(self, tensor: torch.Tensor) -> None:
        if self.world_size > 1:
            dist.all_reduce(tensor)

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """`values` summed over the data-parallel groups: a sequence group's ranks hold the same micro-batches'
        numbers, counted once."""
        totals = torch.tensor(values if self.owner else [0.0] * len(values), dtype=torch.float64, device=self.device)
        self.all_reduce(totals)
        return totals.tolist()


def check_same_count_on_all_ranks(count: int, world_size: int, device: torch.device) -> None:
    """Each forward and backward is a collective, so every rank must run the same number of micro-batches."""
    if world_size == 1 or not dist.is_initialized():  # a plan made for other ranks alone (a test) has none to ask
        return
    counts = torch.tensor([count, -count], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if counts[0].item() != count or -counts[1].item() != count:
        raise ValueError(f"ranks hold different numbers of micro-batches (this rank {count}, max "
                         f"{counts[0].item()}, min {-counts[1].item()}); balance into a multiple of dp_size")


def scale_loss(loss_sum: torch.Tensor, global_count: float, fsdp_ranks: int) -> torch.Tensor:
    """The loss scaling rule (module docstring): a rank's summed loss over the batch's *global* count,
    times `fsdp_ranks`, the ranks FSDP averages gradients over: all of them, also under sequence parallelism,
    where a group's ranks each hold a part of a micro-batch's gradient (`workers.sequence_parallel`)."""
    if float(global_count) <= 0:
        raise ValueError(f"the loss's global count is {float(global_count)}; the batch has nothing to train on "
                         "(no trained token on any rank)")
    return loss_sum / float(global_count) * fsdp_ranks


def row_lengths(attention: torch.Tensor, real_only: bool) -> torch.Tensor:
    """`[N]` tokens per row of an `[N, T]` attention mask: its real ones (`real_only`: what a packed layout
    runs), else up to its last real token (what a padded row costs; a left-padded query's pads count)."""
    if real_only:
        return attention.sum(dim=1)
    columns = torch.arange(1, attention.shape[1] + 1)
    return (columns * attention.bool()).max(dim=1).values


def select(value: torch.Tensor, index: torch.Tensor, width: int) -> torch.Tensor:
    """Rows `index` of a `[N, T]` (first `width` columns) or `[N]` tensor; anything else as it is."""
    if value.dim() == 0:
        return value
    rows = value[index]
    return rows[:, :width] if value.dim() >= 2 else rows


def shared_prompt_units(batch: Batch, units: list[list[int]] | None,
                        max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Units of balancing with shared prompts, and the tokens each runs: the rows with the same prompt
    (`layout.prompt_groups`), packed as the prompt once plus each row's rest, cut into consecutive chunks
    of at most `max_tokens`; a row without actions is a unit alone."""
    if units is not None:
        raise ValueError("share_prompts groups rows by their prompt; it cannot take other units too")
    group, prompt_length = prompt_groups(batch)
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group):
        members.setdefault(g, []).append(row)
    unit_rows: list[list[int]] = []
    unit_tokens: list[int] = []
    for rows in members.values():
        prompt = prompt_length[rows[0]]
        chunk, tokens = [], prompt
        for row in rows:
            if chunk and tokens + lengths[row] - prompt > max_tokens:
                unit_rows.append(chunk)
                unit_tokens.append(tokens)
                chunk, tokens = [], prompt
            chunk.append(row)
            tokens += lengths[row] - prompt
        unit_rows.append(chunk)
        unit_tokens.append(tokens)
    return unit_rows, unit_tokens
