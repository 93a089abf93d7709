"""Embedded inference engine: a small aiohttp server speaking the subset of SGLang's native API
the job uses, running a Hugging Face causal LM on CPU (or one small GPU).

    python -m workers.engines.embedded --model-path DIR --port P [--device cpu] [--dtype float32]

Because it speaks SGLang's API, the router, the rollout client, the weight push and the tests
are the same for both engines. `server.py` holds the HTTP side, `runner.py` the model and the
continuous batching; `workers.engines.rank_engine.start_engine` launches it as a subprocess.
"""

from __future__ import annotations

import sys


def build_engine_argv(model_path: str, port: int, host: str = "127.0.0.1", device: str = "cpu",
                      dtype: str = "float32", max_batch_size: int = 64, num_threads: int = 0,
                      seed: int = 0, python: str = sys.executable) -> list[str]:
    """Command line for `python -m workers.engines.embedded`."""
    return [python, "-m", "workers.engines.embedded", "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--device", device, "--dtype", dtype, "--max-batch-size", str(max_batch_size),
            "--num-threads", str(num_threads), "--seed", str(seed)]
