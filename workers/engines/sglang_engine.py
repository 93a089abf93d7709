"""Command line and environment of a real SGLang server (GPUs; on CPUs a slow test path).

One server per rank (or TP group), launched by the owning rank as
`python -m sglang.launch_server`. Nothing here imports sglang: the job talks to the server over
HTTP only (`workers/engines/rank_engine.py`), exactly as it talks to the embedded engine.
On a CPU rank the server gets the settings SGLang's CPU path needs by itself (`CPU_DEFAULTS`);
`python` may be another environment's interpreter (`rollout.sglang_python`, e.g. the
`.venv-sglang` that `scripts/setup_sglang_cpu.sh` builds).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any, Mapping, Sequence

from workers.engines import ENGINE_KEEPALIVE_S
from workers.engines.spec import EngineSpec, is_vision_language
from workers.procs import ProcessStartError

# Variables torchrun sets for its workers. A server that inherits them takes part in torchrun's
# rendezvous: with TORCHELASTIC_USE_AGENT_STORE=True its own `init_process_group` becomes a store
# client with no store to talk to, and it hangs at "Init torch distributed begin.".
TORCHRUN_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_")
TORCHRUN_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE")


# SGLang on a CPU rank (see docs/engines.md): the memory saver needs a CUDA package
# (release/resume are no-ops without it, and nothing is freed on CPU anyway); the torch-native
# attention backend is the one that runs without AMX; no CUDA graphs; without sleep_on_idle the
# scheduler busy-polls a core even while idle, halving the trainer next to it; and a bounded KV
# budget instead of a share of "device" memory.
CPU_DEFAULTS = {"device": "cpu", "enable_memory_saver": False, "attention_backend": "torch_native",
                "disable_cuda_graph": True, "sleep_on_idle": True, "max_total_tokens": 16384}


# A vision-language model (its config has a `vision_config`) on a CPU rank: its vision tower's attention on plain
# torch. SGLang 0.5.23 picks sdpa itself on a CPU without AMX, but its AMX kernel on one with AMX, which needs the
# CPU build of sgl_kernel (scripts/sglang_cpu has a stand-in without it): every CPU runs the same this way.
VL_CPU_DEFAULTS = {"mm_attention_backend": "sdpa"}


def server_kwargs(spec: EngineSpec, port: int = 30000, log_level: str = "info",
                  extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """ServerArgs fields for a colocated engine serving `spec` (its model_path, host, tp_size,
    mem_fraction_static, dtype and device) on `port`; `extra` (rollout.sglang_args and the
    job's own settings) adds or overrides any.

    On GPUs the memory saver is on so `/release_memory_occupation` really frees the GPU for
    training, `spec.mem_fraction_static` is the engine's share of the GPU next to the trainer, and the
    scheduler sleeps while idle instead of polling a core the trainer needs.
    On CPUs the server gets `CPU_DEFAULTS`.
    """
    if not 0 < spec.mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {spec.mem_fraction_static}")
    if spec.tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {spec.tp_size}")
    kwargs = {"model_path": str(spec.model_path), "host": spec.host, "port": int(port), "tp_size": spec.tp_size,
              "dtype": spec.dtype, "log_level": log_level}
    if spec.device.startswith("cpu"):
        kwargs.update(CPU_DEFAULTS)
        if is_vision_language(spec.model_path):
            kwargs.update(VL_CPU_DEFAULTS)
    else:
        # sleep_on_idle as on CPU: an idle scheduler otherwise pins a core, and the trainer's CPU work beside it
        # stalls (one H200, gpu86m: the trainer's CPU ops took 6-8 ms each while the engine sat idle).
        kwargs.update(mem_fraction_static=spec.mem_fraction_static, enable_memory_saver=True, base_gpu_id=0,
                      sleep_on_idle=True)
    for key, value in (extra or {}).items():
        kwargs[str(key).replace("-", "_")] = value
    return kwargs


def server_python(python: str | None) -> str:
    """The interpreter that runs `sglang.launch_server`, checked before any process starts."""
    if python is None:
        if importlib.util.find_spec("sglang") is None:
            raise ProcessStartError(
                "rollout.engine=sglang but sglang does not import in this Python: install it (GPU: "
                "pip install -e '.[sglang]') or set rollout.sglang_python to an environment that has it "
                "(CPU: bash scripts/setup_sglang_cpu.sh, then rollout.sglang_python=.venv-sglang/bin/python)")
        return sys.executable
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ProcessStartError(f"rollout.sglang_python={python} is not an executable file; build the CPU "
                                "environment with 'bash scripts/setup_sglang_cpu.sh' or give the full path")
    return os.path.abspath(python)  # not resolved: a venv's python is a symlink to the base interpreter


def build_server_argv(kwargs: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """`python -m sglang.launch_server` flags from ServerArgs kwargs (True -> bare flag, False/None -> omitted)."""
    argv = [python, "-m", "sglang.launch_server"]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [flag, *(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def server_env(gpu_ids: Sequence[int] | None, base_env: Mapping[str, str] | None = None,
               device: str = "cuda", vision: bool = False) -> dict[str, str]:
    """The server's environment: the rank's own, minus torchrun's variables, with its GPUs explicit.
    `vision`: it serves a vision-language model (`is_vision_language`)."""
    env = {key: value for key, value in dict(os.environ if base_env is None else base_env).items()
           if key not in TORCHRUN_NAMES and not key.startswith(TORCHRUN_PREFIXES)}
    # Health probes must not generate: a paused or released engine would fail them.
    env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "false"
    # Keep the router's pooled connections open between rollouts (ENGINE_KEEPALIVE_S); a user's own value wins.
    env.setdefault("SGLANG_TIMEOUT_KEEP_ALIVE", str(ENGINE_KEEPALIVE_S))
    # The job stops a server with SIGTERM to its process group; SGLang takes its scheduler's exit for a crash
    # and sleeps 5 s before a py-spy dump and a CUDA coredump, on every stop. A user's own value wins.
    env.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "false")
    env.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "false")
    # expandable_segments breaks torch_memory_saver and CUDA IPC.
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if device.startswith("cpu"):
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # SGLang's switch for its CPU code path
    if vision:
        # SGLang keeps each image's vision-tower output, keyed by the image's hash, and a weight update does not
        # clear it (0.5.23): a pushed vision tower would never reach an image it has seen. 0 turns the cache off.
        env["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
        if device.startswith("cpu"):
            # Its ViT's rotary embedding is torch.compile'd: on CPU Inductor builds C++ code at the first image
            # (9 s of a 33 s test on 2 cores) and needs a C++ compiler on the machine; eager needs neither.
            env.setdefault("TORCHDYNAMO_DISABLE", "1")  # a user's own value wins
    if gpu_ids is not None:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        physical = visible.split(",") if visible else None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(physical[i] if physical else str(i) for i in gpu_ids)
    return env
