"""SGLang launch (argv, environment) and the weight-push payloads both engines receive.

What the job sends is built by pure functions tested here; the calls themselves run against
real SGLang on CPU in test_engine_conformance.py and the job-level tests.
"""

import dataclasses
import sys

import pytest
import torch

from workers.engines.launch import engine_argv
from workers.engines.rank_engine import RELEASE_TAGS, RESUME_AFTER_PUSH, RESUME_BEFORE_PUSH
from workers.engines.spec import EngineSpec
from workers.engines.sglang_engine import build_server_argv, server_env, server_kwargs
from workers.engines.weights import (bucket_named_tensors, deserialize_for_engine, flatten_bucket,
                                     serialize_for_engine, unflatten_bucket, update_tensor_payload)


def flags(argv):
    return {argv[i]: argv[i + 1] for i in range(3, len(argv) - 1)
            if argv[i].startswith("--") and not argv[i + 1].startswith("--")}


def test_server_argv_maps_kwargs_and_extra_server_args_to_flags():
    spec = EngineSpec(kind="sglang", model_path="/models/gpt2", dtype="bfloat16", device="cuda", tp_size=2,
                      mem_fraction_static=0.5)
    kwargs = server_kwargs(spec, port=31234, extra={"attention_backend": "triton",
                                                    "cuda-graph-backend-decode": "disabled",
                                                    "disable_radix_cache": True, "enable_memory_saver": True})
    argv = build_server_argv(kwargs, python="py")
    assert argv[:3] == ["py", "-m", "sglang.launch_server"]
    pairs = flags(argv)
    assert pairs["--model-path"] == "/models/gpt2" and pairs["--port"] == "31234"
    assert pairs["--tp-size"] == "2" and pairs["--mem-fraction-static"] == "0.5"
    assert pairs["--base-gpu-id"] == "0" and pairs["--dtype"] == "bfloat16" and pairs["--host"] == "127.0.0.1"
    assert pairs["--attention-backend"] == "triton" and pairs["--cuda-graph-backend-decode"] == "disabled"
    assert "--enable-memory-saver" in argv and "--disable-radix-cache" in argv
    assert "--sleep-on-idle" in argv  # an idle scheduler would poll a core the trainer needs
    plain = EngineSpec(kind="sglang", model_path="m", dtype="auto", device="cuda")
    assert "--enable-memory-saver" not in build_server_argv(server_kwargs(plain, extra={"enable_memory_saver": False}))
    with pytest.raises(ValueError, match="mem_fraction_static"):
        server_kwargs(dataclasses.replace(plain, mem_fraction_static=1.5))


def test_server_env_drops_torchrun_variables_and_pins_the_rank_gpus():
    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "x",
                "MASTER_PORT": "29500", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RUN_ID": "r",
                "GROUP_RANK": "0", "ROLE_NAME": "default"}
    env = server_env([1], {"PATH": "/bin", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", **torchrun})
    assert not set(torchrun) & set(env)
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false" and "PYTORCH_CUDA_ALLOC_CONF" not in env
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["PATH"] == "/bin"
    # Indices are within the rank's own visible devices.
    assert server_env([0, 1], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert server_env([2], {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})["CUDA_VISIBLE_DEVICES"] == "6"
    # A stop skips SGLang's crash diagnostics (5 s asleep first) unless the user asks for them.
    assert env["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "false"
    assert server_env(None, {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "1"})["SGLANG_PYSPY_DUMP_BEFORE_CRASH"] == "1"


def test_rank_engine_launches_either_kind_with_the_same_settings():
    spec = EngineSpec(kind="sglang", model_path="/m", dtype="bfloat16", device="cuda:1", seed=7, gpu_ids=(1,),
                      sglang_args={"attention_backend": "triton"}, sglang_python=sys.executable)
    argv, env = engine_argv(spec, 30001)
    pairs = flags(argv)
    assert argv[0] == sys.executable
    assert pairs["--random-seed"] == "7" and pairs["--dtype"] == "bfloat16" and pairs["--port"] == "30001"
    assert pairs["--attention-backend"] == "triton" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert "--enable-memory-saver" in argv and "SGLANG_USE_CPU_ENGINE" not in env
    assert "--context-length" not in argv  # not given: SGLang derives it from the model's config
    served = dataclasses.replace(spec, context_length=512)  # the job passes the one its lengths were checked against
    assert flags(engine_argv(served, 30001)[0])["--context-length"] == "512"
    argv, env = engine_argv(EngineSpec(kind="embedded", model_path="/m", dtype="float32", device="cpu", seed=7), 30002)
    assert argv[1:3] == ["-m", "workers.engines.embedded"] and env is None
    assert flags(argv)["--seed"] == "7" and flags(argv)["--port"] == "30002"


def test_buckets_respect_the_byte_budget_and_keep_order():
    tensors = [(f"t{i}", torch.zeros(n, dtype=dtype)) for i, (n, dtype) in
               enumerate([(10, torch.float32), (20, torch.float32), (5, torch.bfloat16), (100, torch.float32),
                          (1, torch.float32)])]
    buckets = list(bucket_named_tensors(tensors, bucket_bytes=130))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1", "t2"], ["t3"], ["t4"]]
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= 130 or len(bucket) == 1  # an oversized tensor travels alone
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(bucket_named_tensors(tensors, 0))


def test_flattened_bucket_round_trips_through_shared_memory_in_mixed_dtypes():
    generator = torch.Generator().manual_seed(0)
    bucket = [("a", torch.randn(3, 4, generator=generator)), ("b", torch.randn(5, generator=generator).bfloat16()),
              ("c", torch.arange(6).reshape(2, 3))]
    staging = torch.empty(1024, dtype=torch.uint8)
    received = unflatten_bucket(deserialize_for_engine(serialize_for_engine(flatten_bucket(bucket, out=staging))))
    assert [name for name, _ in received] == ["a", "b", "c"]
    for (_, sent), (_, got) in zip(bucket, received):
        assert got.dtype == sent.dtype and torch.equal(got, sent)


def test_payload_flushes_and_versions_only_on_the_last_bucket():
    middle = update_tensor_payload("abc", tp_size=2, is_last=False, weight_version="3")
    last = update_tensor_payload("abc", tp_size=2, is_last=True, weight_version="3")
    paused = update_tensor_payload("abc", tp_size=1, is_last=True, weight_version="3", flush_cache=False)
    assert middle == {"serialized_named_tensors": ["abc", "abc"], "load_format": "flattened_bucket",
                      "flush_cache": False}
    assert last["flush_cache"] is True and last["weight_version"] == "3"
    assert paused["flush_cache"] is False and paused["weight_version"] == "3"


def test_memory_tags_resume_weights_before_the_push_and_kv_cache_after():
    assert set(RELEASE_TAGS) == {"weights", "kv_cache"}
    assert RESUME_BEFORE_PUSH == ("weights",) and RESUME_AFTER_PUSH == ("kv_cache",)


def test_a_cpu_rank_gets_sglangs_cpu_settings_still_overridable():
    spec = EngineSpec(kind="sglang", model_path="/m", dtype="float32", device="cpu", sglang_python=sys.executable,
                      sglang_args={"max_total_tokens": 4096})
    argv, env = engine_argv(spec, 30003)
    pairs = flags(argv)
    assert pairs["--device"] == "cpu" and pairs["--attention-backend"] == "torch_native"
    assert pairs["--max-total-tokens"] == "4096"  # rollout.sglang_args wins
    assert "--disable-cuda-graph" in argv and "--sleep-on-idle" in argv
    assert "--enable-memory-saver" not in argv and "--mem-fraction-static" not in argv
    assert env["SGLANG_USE_CPU_ENGINE"] == "1"


def test_the_server_interpreter_is_checked_before_anything_starts(tmp_path):
    from workers.engines.sglang_engine import server_python
    from workers.procs import ProcessStartError

    with pytest.raises(ProcessStartError, match="rollout.sglang_python=.*not an executable file"):
        server_python(str(tmp_path / "no-python"))
    assert server_python(sys.executable) == sys.executable
    try:
        import sglang  # noqa: F401
    except ImportError:  # this environment has none: the error says how to get one
        with pytest.raises(ProcessStartError, match="setup_sglang_cpu.sh"):
            server_python(None)


def test_the_planned_kv_pool_becomes_max_total_tokens_unless_sglang_args_set_it():
    def pool(**spec_kwargs):
        spec = EngineSpec(kind="sglang", model_path="/m", dtype="bfloat16", device="cuda:0",
                          sglang_python=sys.executable, **spec_kwargs)
        return flags(engine_argv(spec, 30004)[0]).get("--max-total-tokens")

    assert pool(kv_tokens=28672) == "28672"  # the memory plan's size, not SGLang's share of the GPU
    assert pool(kv_tokens=28672, sglang_args={"max_total_tokens": 4096}) == "4096"  # the user's own wins
    assert pool() is None  # no plan: SGLang sizes the pool from mem_fraction_static
    cpu = EngineSpec(kind="sglang", model_path="/m", dtype="float32", device="cpu", sglang_python=sys.executable)
    assert flags(engine_argv(cpu, 30005)[0])["--max-total-tokens"] == "16384"  # the CPU default stays
