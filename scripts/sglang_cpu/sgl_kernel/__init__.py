"""A pure-torch stand-in for the CPU build of `sgl_kernel`, for SGLang 0.5.23 on CPUs without AMX.

Why: SGLang's CPU path imports `sgl_kernel.assign_req_to_token_pool_cpu` unconditionally and runs
it on every batch, but the package index has only CUDA builds of sgl_kernel (and not its
source). On a CPU without AMX every other op SGLang uses falls back to pure torch, so this one
function is all that is missing. Installed into .venv-sglang by scripts/setup_sglang_cpu.sh;
tied to sglang 0.5.23 (re-check on upgrade). Any other attribute raises NotImplementedError when
called, so a new dependency shows up as a clear error, never as a wrong result.

Some SGLang modules look kernels up as torch operators at import (`torch.ops.sgl_kernel.NAME`), not
as attributes of this module: those names are registered below as operators that raise the same way.
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


# Looked up at import by sglang.srt.models.qwen3_5, which SGLang's Qwen-VL processor module imports: without
# them no Qwen2-VL/2.5-VL/3-VL model starts ("No processor registered for architecture"). Qwen3.5 calls them;
# the VL models do not. The schemas follow the call sites in qwen3_5.py (never called here, so only their
# names matter). convert_weight_packed must never be registered: SGLang takes it for an AMX build.
_QK_NORM = "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim)"
IMPORT_TIME_OPS = {
    "fused_sigmoid_mul_cpu": "(Tensor(a!) x, Tensor gate) -> ()",
    "fused_qk_gemma_rmsnorm_cpu": _QK_NORM + " -> (Tensor, Tensor)",
    "fused_qk_gemma_rmsnorm_with_gate_cpu": _QK_NORM + " -> (Tensor, Tensor, Tensor)",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu":
        "(Tensor qkvz, Tensor ba, int num_k_heads, int num_v_heads, int head_k_dim, int head_v_dim)"
        " -> (Tensor, Tensor, Tensor, Tensor)",
}


def _missing(name: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not in the CPU stand-in (scripts/sglang_cpu/sgl_kernel): this SGLang "
            "build needs a kernel the stand-in lacks; only sglang 0.5.23 on CPU is supported")
    return missing


def _register_import_time_ops() -> None:
    if hasattr(torch.ops.sgl_kernel, next(iter(IMPORT_TIME_OPS))):  # a real CPU build (or a reload) has them
        return
    global _LIBRARY
    _LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")  # kept alive: dropping it unregisters the ops
    for name, schema in IMPORT_TIME_OPS.items():
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, _missing(name), "CompositeExplicitAutograd")


_register_import_time_ops()


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
