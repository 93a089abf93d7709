"""SGLang launch (argv, environment) and the weight-push payloads both engines receive.

What the job sends is built by pure functions tested here; the calls themselves run against
real SGLang on CPU in test_engine_conformance.py and the job-level tests.
"""

import dataclasses
import sys
from pathlib import Path

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


# --------------------------------------------------------------------------- vision-language models (issue 71)

QWEN25_VL = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
             "vision_config": {"depth": 1}}


def test_a_vision_language_model_gets_sglangs_vl_settings(tmp_path):
    import json

    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps(QWEN25_VL))
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))

    def launch(model, device="cpu", **kwargs):
        spec = EngineSpec(kind="sglang", model_path=str(tmp_path / model), dtype="float32", device=device,
                          sglang_python=sys.executable, **kwargs)
        return engine_argv(spec, 30006)

    argv, env = launch("vl")
    assert flags(argv)["--mm-attention-backend"] == "sdpa"
    assert env["SGLANG_VLM_CACHE_SIZE_MB"] == "0" and env["TORCHDYNAMO_DISABLE"] == "1"
    argv, env = launch("vl", sglang_args={"mm_attention_backend": "triton_attn"})
    assert flags(argv)["--mm-attention-backend"] == "triton_attn"  # rollout.sglang_args wins
    argv, env = launch("vl", device="cuda:0")  # a GPU keeps SGLang's own backend and dynamo, never the cache
    assert "--mm-attention-backend" not in argv and "TORCHDYNAMO_DISABLE" not in env
    assert env["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    with pytest.MonkeyPatch.context() as patch:  # the rank's own dynamo setting wins; the image cache stays off
        patch.setenv("TORCHDYNAMO_DISABLE", "0")
        patch.setenv("SGLANG_VLM_CACHE_SIZE_MB", "100")
        env = launch("vl")[1]
        assert env["TORCHDYNAMO_DISABLE"] == "0" and env["SGLANG_VLM_CACHE_SIZE_MB"] == "0"
    for model in ("text", "no-such-dir"):
        argv, env = launch(model)
        assert "--mm-attention-backend" not in argv
        assert "SGLANG_VLM_CACHE_SIZE_MB" not in env and "TORCHDYNAMO_DISABLE" not in env
    # A hub name: its config from the local hub cache, where the trainer's load put it.
    import huggingface_hub

    cache = {("org/vl", "config.json"): str(tmp_path / "vl" / "config.json")}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: cache.get((repo, name)))
        spec = EngineSpec(kind="sglang", model_path="org/vl", dtype="float32", device="cpu",
                          sglang_python=sys.executable)
        assert flags(engine_argv(spec, 30007)[0])["--mm-attention-backend"] == "sdpa"


def test_pushes_go_under_the_checkpoints_names(tmp_path):
    """A Qwen2.5-VL's in-memory names reach the engine as its checkpoint's (what SGLang takes); checkpoint names
    and every text model's names go as they are, byte for byte."""
    import json

    from workers.engines.weights import WeightPusher
    from workers.loading import checkpoint_renamer, model_checkpoint_renamer

    rename = checkpoint_renamer(QWEN25_VL)
    assert [rename(name) for name in ("model.visual.blocks.0.mlp.gate_up_proj.weight",
                                      "model.language_model.layers.0.mlp.up_proj.weight",
                                      "model.language_model.embed_tokens.weight", "lm_head.weight",
                                      "visual.merger.mlp.0.bias", "model.norm.weight")] == [
        "visual.blocks.0.mlp.gate_up_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.embed_tokens.weight",
        "lm_head.weight", "visual.merger.mlp.0.bias", "model.norm.weight"]
    assert checkpoint_renamer({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}) is None
    # Qwen3-VL's checkpoint already uses transformers' in-memory names.
    assert checkpoint_renamer({"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
                               "vision_config": {}}) is None

    for model, config in (("vl", QWEN25_VL), ("text", {"architectures": ["Qwen2ForCausalLM"]})):
        (tmp_path / model).mkdir()
        (tmp_path / model / "config.json").write_text(json.dumps(config))
    tensors = [("model.visual.patch_embed.proj.weight", torch.ones(2)),
               ("model.language_model.layers.0.self_attn.q_proj.weight", torch.ones(2)),
               ("lm_head.weight", torch.ones(2))]
    sent = {}
    for model in ("vl", "text"):  # the renamer RankEngine.launch gives the pusher for the served model
        pusher = WeightPusher(torch.float32, rename=model_checkpoint_renamer(str(tmp_path / model)))
        sent[model] = [name for payload, _, _ in pusher.payloads(tensors, "1")
                       for name, _ in unflatten_bucket(deserialize_for_engine(payload["serialized_named_tensors"][0]))]
    assert sent["vl"] == ["visual.patch_embed.proj.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    assert sent["text"] == [name for name, _ in tensors]


def test_a_vl_checkpoint_loads_as_a_policy_whose_logprobs_are_the_models_own(tiny_model_dir, tmp_path):
    """`model_builder.build_frozen(kind="causal_lm")` of a VL checkpoint is transformers' image-text model, vision
    tower included, and the trainer's forward on a row with an image gives that model's own logprobs."""
    import numpy as np
    from PIL import Image
    from transformers import AutoModelForImageTextToText

    from offline.vision import save_vision_model
    from rl_core.model_builder import Placement, build_frozen
    from workers.forward import token_logprobs_and_entropy
    from workers.layout import rows_to_batch
    from workers.vision import expand_image_pads, image_token_counts, load_processor, vision_inputs, with_vision

    path = save_vision_model("qwen2_5_vl", tiny_model_dir, tmp_path / "vl")
    policy = build_frozen(path, "causal_lm", None, Placement.whole(torch.device("cpu")))
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    assert type(policy) is type(reference) and any(name.startswith("model.visual.") for name, _ in
                                                   policy.named_parameters())
    processor = load_processor(path)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = vision_inputs(processor, [image])
    pad_id, merge = policy.config.image_token_id, policy.config.vision_config.spatial_merge_size
    ids = expand_image_pads(processor.tokenizer(prompt)["input_ids"], pad_id,
                            image_token_counts(inputs["image_grid_thw"], merge))
    ids += [5, 6, 7, 8]
    batch = with_vision(rows_to_batch([{"input_ids": ids, "action_mask": [0] * (len(ids) - 4) + [1] * 4}], 1),
                        policy, inputs["pixel_values"], inputs["image_grid_thw"])
    with torch.no_grad():
        logprobs, _ = token_logprobs_and_entropy(policy, batch, 1.0, actions_only=True)
        tensor = torch.tensor([ids])
        logits = reference(input_ids=tensor, mm_token_type_ids=(tensor == pad_id).int(), **inputs).logits[0, :-1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, tensor[0, 1:, None]).squeeze(-1)[-4:]
    torch.testing.assert_close(logprobs[0, -4:], expected, atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def vl_served(tiny_model_dir, tmp_path_factory):
    """A tiny Qwen2.5-VL served by both engines exactly as the job launches them (`start_engine` from a spec,
    nothing else): the model's directory, kind -> url, and an image file."""
    import numpy as np
    from PIL import Image

    from offline.vision import save_vision_model
    from tests.sglang_env import require_sglang_python
    from workers.engines.launch import start_engine
    from workers.procs import ManagedProcesses

    python = require_sglang_python()
    root = tmp_path_factory.mktemp("vl_served")
    model = save_vision_model("qwen2_5_vl", tiny_model_dir, root / "model")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (56, 56, 3), dtype=np.uint8)).save(root / "image.png")
    specs = {"embedded": EngineSpec(kind="embedded", model_path=model, dtype="float32", device="cpu", num_threads=1),
             "sglang": EngineSpec(kind="sglang", model_path=model, dtype="float32", device="cpu", num_threads=1,
                                  sglang_python=python, context_length=512)}
    with ManagedProcesses() as procs:
        started = {kind: start_engine(spec, root / f"{kind}.log", procs, deadline_s=300, wait=False)
                   for kind, spec in specs.items()}
        for engine in started.values():
            engine.wait_ready(300)
        yield model, {kind: engine.url for kind, engine in started.items()}, str(root / "image.png")


@pytest.mark.timeout(400)
def test_sglang_serves_a_vl_model_as_launched_and_takes_the_trainers_push(vl_served):
    """The trainer's whole model (vision tower included), pushed by the job's pusher under its in-memory names,
    reaches SGLang: an image it served before the push is answered with the new weights (no stale vision
    cache), greedy ids equal the embedded engine's after the same push, and the weight version is the push's."""
    import asyncio

    from rl_core.model_builder import load
    from workers.engines.client import EngineClient
    from workers.engines.rank_engine import RankEngine
    from workers.engines.weights import WeightPusher
    from workers.loading import model_checkpoint_renamer
    from workers.vision import load_processor

    model, urls, image = vl_served
    processor = load_processor(model)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}]
    prompt = processor.tokenizer(processor.apply_chat_template(messages, add_generation_prompt=True,
                                                               tokenize=False))["input_ids"]
    trainer = load(model, "causal_lm", None)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in trainer.named_parameters():
            param.add_(torch.randn(param.shape, generator=generator) * (0.5 if ".visual." in name else 0.05))
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def generate(url):
        async with EngineClient(url, timeout_s=120) as client:
            return await client.generate(prompt, greedy, image_data=[image])

    def serve(url):  # the job's pusher and renamer (RankEngine.launch's) for the served model
        pusher = WeightPusher(torch.float32, bucket_bytes=64 << 20, rename=model_checkpoint_renamer(str(model)))
        before = asyncio.run(generate(url))
        with RankEngine(url, Path("engine.log"), pusher, 1e-4) as engine:
            engine.push(trainer.state_dict().items(), "pushed", None, None)
        return before, asyncio.run(generate(url))
    answers = {kind: serve(url) for kind, url in urls.items()}

    def logprobs(answer):
        return torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
    (before, pushed), (sglang_before, sglang_pushed) = answers["embedded"], answers["sglang"]
    assert sglang_before["output_ids"] == before["output_ids"]
    assert sglang_pushed["output_ids"] == pushed["output_ids"] and sglang_pushed["meta_info"]["image_tokens"] == 4
    torch.testing.assert_close(logprobs(sglang_pushed), logprobs(pushed), atol=1e-4, rtol=0)
    assert (logprobs(sglang_pushed) - logprobs(sglang_before)).abs().max() > 1e-2
    assert sglang_pushed["meta_info"]["weight_version"] == "pushed"
