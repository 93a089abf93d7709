"""Embedded inference engine: a small aiohttp server speaking the subset of SGLang's native API
the job uses, running a Hugging Face causal LM on CPU (or one small GPU).

    python -m workers.engines.embedded --model-path DIR --port P [--device cpu] [--dtype float32]

Because it speaks SGLang's API, the router, the rollout client, the weight push and the tests
are the same for both engines. `server.py` holds the HTTP side, `runner.py` the model and the
continuous batching; `workers.engines.launch.start_engine` launches it as a subprocess, or, in a job,
in a fork of its rank made before the job's set-up (`forked.py`: the rank's imports, not a second Python's).
"""

from __future__ import annotations

import sys

from workers.engines.spec import EngineSpec


def build_engine_argv(spec: EngineSpec, port: int, python: str = sys.executable) -> list[str]:
    """Command line for `python -m workers.engines.embedded` serving `spec` (its model, host, device,
    dtype, max_batch_size, num_threads and seed) on `port`."""
    return [python, "-m", "workers.engines.embedded", "--model-path", str(spec.model_path), "--host", spec.host,
            "--port", str(port), "--device", spec.device, "--dtype", spec.dtype,
            "--max-batch-size", str(spec.max_batch_size), "--num-threads", str(spec.num_threads),
            "--seed", str(spec.seed)]
