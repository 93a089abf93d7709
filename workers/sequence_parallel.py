"""Sequence parallelism (Ulysses): the ranks of a sequence group run one packed micro-batch together,
each holding 1/N of its tokens, so a sequence N times longer fits a device.

Why Ulysses rather than ring attention: it needs no attention kernel of its own. Around each attention
call, one all-to-all trades "my tokens, all heads" for "all tokens, my heads"; the model's own kernel
(sdpa, or eager for soft-capped Gemma 2) then runs on whole sequences with the layout's mask, exactly as
without parallelism, and a second all-to-all trades back. The cost is that the query and key/value head
counts must divide by N.

The device mesh is dp x sp: FSDP2 shards parameters over all ranks, `workers.balance` gives each data-
parallel group its micro-batches, and the N ranks of a sequence group run the same ones. Gradients
stay exact with the one loss-scaling rule (`worker.scale_loss` over *all* ranks) because each parameter's
gradient is split, not repeated, across a group: attention's all-to-alls send gradients back to the
tokens' owners, the LM head runs on a different 1/N of the tokens on each rank (`split`), and the small
per-token results are gathered with a backward that keeps only the rank's own share (`gather_replicated`),
since every rank of the group then computes the same loss from them.

The collectives are written here with their backward passes because these two gather semantics (sum
the gradient back, or keep one's own slice) are the point; `torch.distributed.nn` has the first only
and is deprecated.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "ulysses_"


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's place in the dp x sp mesh: its sequence group (`size` ranks, it being `rank`) and its
    data-parallel group (`dp_rank` of `dp_size`)."""

    group: object
    rank: int
    size: int
    dp_rank: int
    dp_size: int

    @classmethod
    def build(cls, world_size: int, sequence_parallel: int, device: torch.device) -> "SequenceGroup | None":
        """The groups of a `sequence_parallel`-wide split (None when it is 1). Collective: every rank calls it."""
        check_sequence_parallel(sequence_parallel, world_size)
        if sequence_parallel == 1:
            return None
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (world_size // sequence_parallel, sequence_parallel),
                                mesh_dim_names=("dp", "sp"))
        return cls(mesh.get_group("sp"), mesh.get_local_rank("sp"), sequence_parallel,
                   mesh.get_local_rank("dp"), world_size // sequence_parallel)

    # ------------------------------------------------------------------ inputs and outputs

    def shard(self, columns: torch.Tensor) -> torch.Tensor:
        """This rank's `1/size` of `[n, L]` columns (`L` a multiple of `size`: `layout.pack` pads it)."""
        return columns.chunk(self.size, dim=1)[self.rank]

    def gather_hidden(self, local: torch.Tensor) -> torch.Tensor:
        """`[n, L/size, ...]` -> `[n, L, ...]`; the backward sums every rank's gradient and keeps this rank's part."""
        return _GatherSum.apply(local, self)

    def gather_replicated(self, local: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Every rank's `local` (same shapes) concatenated along `dim`, for a loss every rank computes alike:
        the backward keeps this rank's slice of the gradient."""
        return _GatherReplicated.apply(local, self, dim)

    def split(self, count: int) -> tuple[int, int, int]:
        """This rank's `[start, stop)` of `count` items in near-equal shares, and the largest share."""
        share = -(-count // self.size)
        start = min(self.rank * share, count)
        return start, min(start + share, count), share


def check_sequence_parallel(sequence_parallel: int, world_size: int) -> None:
    if sequence_parallel < 1 or world_size % sequence_parallel:
        raise ValueError(f"model.sequence_parallel={sequence_parallel} must be >= 1 and divide the world size "
                         f"{world_size} (ranks = data-parallel x sequence-parallel); pick a divisor of {world_size}")


def check_heads(config, sequence_parallel: int, key: str = "model.sequence_parallel") -> None:
    """Ulysses splits attention heads over the group: both head counts must divide by its size."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for name, count in (("attention", heads), ("key/value", kv_heads)):
        if count is None or count % sequence_parallel:
            raise ValueError(f"{key}={sequence_parallel} must divide the model's {name} head count ({count}): "
                             f"Ulysses gives each rank of a sequence group 1/{sequence_parallel} of the heads; "
                             "pick a divisor of both head counts")


def enable(model, sequence_parallel: int) -> None:
    """Route `model`'s attention through `ulysses_attention` around its own kernel (checked: heads divide)."""
    config = model.config
    check_heads(config, sequence_parallel)
    inner = config._attn_implementation
    if "flash" in inner:
        raise ValueError(f"model.sequence_parallel with attn_implementation={inner} is not supported: its varlen "
                         "layout has no mask to split by; use sdpa (or eager) with model.sequence_parallel > 1")
    if not inner.startswith(PREFIX):
        model.set_attn_implementation(PREFIX + inner)


# --------------------------------------------------------------------------- attention


def ulysses_attention(module, query, key, value, attention_mask, sequence_group: SequenceGroup | None = None,
                      **kwargs):
    """The model's own attention on whole sequences with 1/N of the heads. `query`/`key`/`value` are
    `[n, heads, L/N, d]` (this rank's tokens), `attention_mask` the whole packed rows' mask; returns
    `[n, L/N, heads, d]` as transformers' kernels do. Without a group (a model run outside a sequence-
    parallel micro-batch) it is the model's kernel alone."""
    inner_name = module.config._attn_implementation.removeprefix(PREFIX)
    if inner_name == "eager":  # each model file has its own eager kernel (Gemma 2's soft-caps its scores)
        inner = sys.modules[type(module).__module__].eager_attention_forward
    else:
        inner = ALL_ATTENTION_FUNCTIONS[inner_name]
    if sequence_group is None:
        return inner(module, query, key, value, attention_mask, **kwargs)
    query, key, value = (_all_to_all(x, sequence_group, split_dim=1, join_dim=2) for x in (query, key, value))
    output, weights = inner(module, query, key, value, attention_mask, **kwargs)
    return _all_to_all(output, sequence_group, split_dim=1, join_dim=2), weights


# transformers' registries are its extension point: the wrapped kernels under their own names, and the
# masks they read (for a model run outside a micro-batch, e.g. decoding) the inner kernel's.
for _name in ("sdpa", "eager"):
    AttentionInterface.register(PREFIX + _name, ulysses_attention)
    AttentionMaskInterface.register(PREFIX + _name, ALL_MASK_ATTENTION_FUNCTIONS[_name])


# --------------------------------------------------------------------------- collectives with their backward


def _all_to_all(x: torch.Tensor, group: SequenceGroup, split_dim: int, join_dim: int) -> torch.Tensor:
    """Cut `x` into `size` parts along `split_dim`, send part i to rank i, join what arrives along `join_dim`
    in rank order. Heads -> tokens on the way in (`[n, H, L/N, d]` -> `[n, H/N, L, d]`) and, with the output's
    `[n, L, H/N, d]`, tokens -> heads on the way out."""
    return _AllToAll.apply(x, group, split_dim, join_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group: SequenceGroup, split_dim: int, join_dim: int):
        ctx.group, ctx.split_dim, ctx.join_dim = group, split_dim, join_dim
        return _exchange(x, group, split_dim, join_dim)

    @staticmethod
    def backward(ctx, grad):  # the same exchange the other way round
        return _exchange(grad, ctx.group, ctx.join_dim, ctx.split_dim), None, None, None


def _exchange(x: torch.Tensor, group: SequenceGroup, split_dim: int, join_dim: int) -> torch.Tensor:
    parts = [part.contiguous() for part in x.chunk(group.size, dim=split_dim)]
    received = [torch.empty_like(part) for part in parts]
    dist.all_to_all(received, parts, group=group.group)
    return torch.cat(received, dim=join_dim)


def _all_gather(x: torch.Tensor, group: SequenceGroup, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(group.size)]
    dist.all_gather(parts, x.contiguous(), group=group.group)
    return torch.cat(parts, dim=dim)


class _GatherSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group: SequenceGroup):
        ctx.group = group
        return _all_gather(local, group, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group.group)
        return grad.chunk(ctx.group.size, dim=1)[ctx.group.rank], None


class _GatherReplicated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local, group: SequenceGroup, dim: int):
        ctx.group, ctx.dim = group, dim
        return _all_gather(local, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.group.size, dim=ctx.dim)[ctx.group.rank], None, None
