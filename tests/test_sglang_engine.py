"""SGLang launcher: pure argv/env/bucket/payload builders, and the weight push against a real
embedded engine (which speaks the same session + /update_weights_from_tensor protocol)."""

import asyncio
import re

import pytest
import torch

from workers.engines.embedded import launch_embedded_engine
from workers.engines.sglang_engine import (RELEASE_TAGS, RESUME_AFTER_UPDATE, RESUME_BEFORE_UPDATE, SGLangEngine,
                                           bucket_named_tensors, build_server_argv, server_env, server_kwargs,
                                           update_tensor_payload)
from workers.engines.weights import flatten_bucket, serialize_for_engine, weights_checksum
from workers.procs import ManagedProcesses


def test_server_argv_maps_kwargs_to_flags():
    kwargs = server_kwargs("/models/gpt2", port=31234, tp_size=2, mem_fraction_static=0.5, base_gpu_id=2,
                           dtype="bfloat16")
    argv = build_server_argv(kwargs, python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    pairs = {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1) if not argv[i + 1].startswith("--")}
    assert pairs["--model-path"] == "/models/gpt2" and pairs["--port"] == "31234"
    assert pairs["--tp-size"] == "2" and pairs["--mem-fraction-static"] == "0.5"
    assert pairs["--base-gpu-id"] == "2" and pairs["--dtype"] == "bfloat16" and pairs["--host"] == "127.0.0.1"
    assert "--enable-memory-saver" in argv and "--skip-tokenizer-init" not in argv
    assert "--enable-memory-saver" not in build_server_argv(server_kwargs("m", enable_memory_saver=False))
    with pytest.raises(ValueError, match="mem_fraction_static"):
        server_kwargs("m", mem_fraction_static=1.5)


def test_server_env_disables_generating_health_probes_and_expandable_segments():
    env = server_env({"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "2,3")
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["PATH"] == "/bin"


def test_buckets_respect_the_byte_budget_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, (n, dtype) in
               enumerate([(10, torch.float32), (20, torch.float32), (5, torch.bfloat16), (100, torch.float32),
                          (1, torch.float32)])]
    buckets = bucket_named_tensors(tensors, bucket_bytes=130)
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1", "t2"], ["t3"], ["t4"]]
    assert [name for b in buckets for name, _ in b] == [name for name, _ in tensors]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 130 or len(bucket) == 1  # an oversized tensor travels alone
    with pytest.raises(ValueError, match="bucket_bytes"):
        bucket_named_tensors(tensors, 0)


def test_payload_flushes_and_versions_only_on_the_last_bucket():
    middle = update_tensor_payload("abc", tp_size=2, is_last=False, weight_version="v3")
    last = update_tensor_payload("abc", tp_size=2, is_last=True, weight_version="v3")
    assert middle == {"serialized_named_tensors": ["abc", "abc"], "load_format": "flattened_bucket",
                      "flush_cache": False}
    assert last["flush_cache"] is True and last["weight_version"] == "v3"


def test_memory_tags_resume_weights_before_the_update_and_kv_cache_after():
    assert set(RELEASE_TAGS) == {"weights", "kv_cache"}
    assert RESUME_BEFORE_UPDATE == ("weights",) and RESUME_AFTER_UPDATE == ("kv_cache",)


def embedded_serializer(bucket):
    return serialize_for_engine(flatten_bucket(bucket))


@pytest.mark.timeout(180)
def test_release_push_resume_sequence_on_an_engine_speaking_the_protocol(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(-1.0)
    named = list(model.state_dict().items())
    log = tmp_path / "engine.log"
    with ManagedProcesses() as procs:
        embedded = launch_embedded_engine(tiny_model_dir, log, processes=procs, num_threads=1)
        port = int(embedded.url.rsplit(":", 1)[1])
        engine = SGLangEngine(tiny_model_dir, tmp_path / "unused.log", port=port, bucket_bytes=8 << 10)

        async def body():
            await engine.release_memory()
            buckets = await engine.update_weights(named, "step-1", serialize=embedded_serializer)
            checksum = await engine.client.weights_checksum()
            await engine.close()
            return buckets, checksum
        buckets, checksum = asyncio.run(body())
    assert buckets > 2
    assert checksum == {"weight_version": "step-1", "checksum": weights_checksum(model)}
    events = [m.group(1) for m in re.finditer(
        r"(release_memory_occupation tags=\S+|resume_memory_occupation tags=\S+|begin_weight_update|"
        r"end_weight_update|loaded \d+ tensors from tensor payload in \S+ weight_version=\S+)", log.read_text())]
    loads = [e for e in events if e.startswith("loaded")]
    assert len(loads) == buckets
    assert all(e.endswith("weight_version=default") for e in loads[:-1]) and loads[-1].endswith("=step-1")
    assert events[0] == "release_memory_occupation tags=" + ",".join(RELEASE_TAGS)
    assert events[1:3] == ["resume_memory_occupation tags=weights", "begin_weight_update"]
    assert events[-2:] == ["end_weight_update", "resume_memory_occupation tags=kv_cache"]
