"""A pure-torch stand-in for the CPU build of `sgl_kernel`, for SGLang 0.5.23 on CPUs without AMX.

Why: SGLang's CPU path imports `sgl_kernel.assign_req_to_token_pool_cpu` unconditionally and runs
it on every batch, but the package index has only CUDA builds of sgl_kernel (and not its
source). On a CPU without AMX every other op SGLang uses falls back to pure torch, so this one
function is all that is missing. Installed into .venv-sglang by scripts/setup_sglang_cpu.sh;
tied to sglang 0.5.23 (re-check on upgrade). Any other attribute raises NotImplementedError when
called, so a new dependency shows up as a clear error, never as a wrong result.
"""

import torch

__version__ = "0.0.0+rl_core.cpu.stand_in"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """Row r of the batch owns KV slots [start_offset[r], end_offset[r]) of request
    req_pool_indices[r]; fill them, in order, with the next entries of out_cache_loc."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        count = end - start
        assert 0 <= start <= end <= pool_len, f"KV range [{start}, {end}) outside the pool of {pool_len}"
        req_to_token[row, start:end] = out_cache_loc[taken:taken + count].to(req_to_token.dtype)
        taken += count


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in the CPU stand-in (scripts/sglang_cpu/sgl_kernel): this SGLang "
            "build needs a kernel the stand-in lacks; only sglang 0.5.23 on CPU is supported")
    return missing
