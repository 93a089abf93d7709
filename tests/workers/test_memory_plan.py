"""The memory plan with the sizes of real models and devices: KV bytes per token from real `transformers`
configs (checked against hand computations), the decision whether trainer and engine fit, the KV pool."""

import pytest

from workers.memory_plan import (ACTIVATION_VALUES, GIB, Device, MemoryInputs, ModelShape, decide_release, detect_device, model_shape,
                                 plan_memory)

H100 = Device.of("cuda", 80 * 10**9)  # an H100's 80 GB (79.6 GiB as torch reports it; 80e9 here)


def gpt2_86m():
    """The issue's ~86M GPT-2: 12 layers, width 768, the tiny tokenizer's 8192-token vocabulary."""
    from transformers import GPT2Config

    return GPT2Config(n_layer=12, n_head=12, n_embd=768, vocab_size=8192, n_positions=1024,
                      bos_token_id=0, eos_token_id=0)


def llama_7b():
    """Llama-2-7B: 32 layers of 32 heads x 128 (no GQA), width 4096, vocabulary 32000."""
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=32, vocab_size=32000)


def test_kv_bytes_per_token_from_real_configs_of_each_family():
    from transformers import GemmaConfig, LlamaConfig, Qwen3Config

    # GPT-2 names its sizes n_layer/n_head/n_embd: 2 (K, V) x 12 layers x 12 heads x 64 (768/12) x 2 bytes = 36864.
    assert model_shape(gpt2_86m(), params=1).kv_bytes_per_token(2) == 36864
    # Llama-3-8B, GQA: 2 x 32 layers x 8 KV heads (of 32) x 128 x 2 bytes = 131072 (128 KiB), a quarter of MHA's.
    llama3 = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         vocab_size=128256)
    assert model_shape(llama3, params=1).kv_bytes_per_token(2) == 131072
    # Qwen3-0.6B: head_dim 128 is not hidden/heads (1024/16 = 64): 2 x 28 x 8 x 128 x 2 = 114688 (112 KiB).
    qwen3 = Qwen3Config(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                        head_dim=128, vocab_size=151936)
    assert model_shape(qwen3, params=1).kv_bytes_per_token(2) == 114688
    # Gemma-2B, MQA: one KV head of 256: 2 x 18 x 1 x 256 x 2 = 18432; in float32 twice that.
    gemma = GemmaConfig(hidden_size=2048, num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1,
                        head_dim=256, vocab_size=256000)
    assert model_shape(gemma, params=1).kv_bytes_per_token(2) == 18432
    assert model_shape(gemma, params=1).kv_bytes_per_token(4) == 36864


def test_parameters_are_counted_from_the_config_without_weights():
    # GPT-2: 12 blocks of 12 x 768^2 + 13 x 768 weights (attention 4 x 768^2 + 4 x 768, MLP 8 x 768^2 + 5 x 768,
    # two layer norms 4 x 768), embeddings (8192 + 1024) x 768, final norm 2 x 768; the head is tied.
    d = 768
    by_hand = 12 * (12 * d * d + 13 * d) + (8192 + 1024) * d + 2 * d
    assert model_shape(gpt2_86m()).params == by_hand == 92_133_888


def inputs_86m(**overrides) -> MemoryInputs:
    """bench_train.py's gpu86m setting: GRPO (no critic) with a KL reference, bf16 mixed precision, 32 x 8 = 256
    episodes of 64 + 48 tokens, all in flight on one engine."""
    settings = dict(policy=model_shape(gpt2_86m(), params=92_133_888), engine_dtype_bytes=2, master_dtype_bytes=4,
                    compute_dtype_bytes=2, trained_models=1, frozen_params=92_133_888, sequences_in_flight=256,
                    sequence_tokens=112, min_kv_tokens=1024, max_tokens_per_device=8192, logits_chunk=1024,
                    engine_static_bytes=int(0.6 * H100.total_bytes))
    return MemoryInputs(**{**settings, **overrides})


def test_86m_gpt2_on_an_h100_fits_next_to_its_engine_so_it_never_releases():
    plan = plan_memory(inputs_86m(), H100)
    assert plan.fits and plan.trainer_fits
    assert not decide_release("auto", plan)
    # fp32 master weights, gradients and Adam's two moments, one rank: 4 + 4 + 8 bytes per weight.
    assert plan.trainer_params == plan.trainer_grads == 92_133_888 * 4
    assert plan.trainer_optimizer == 2 * 92_133_888 * 4
    assert plan.engine_weights == 92_133_888 * 2  # bf16 engine
    # The pool holds the whole batch at its longest: 256 x (64 + 48) tokens, not a share of the GPU.
    assert plan.work_tokens == plan.kv_tokens == 256 * 112
    assert plan.engine_kv == 256 * 112 * 36864  # about 1 GB
    assert plan.trainer_total + plan.engine_total < 8 * GIB  # 6.3 GiB of it the trainer's (an H200 measured 7.7)


def test_activations_follow_the_stated_estimate():
    plan_inputs = inputs_86m()
    # 8192 tokens x 12 layers x 64 x 768 bytes (bf16), plus 3 float32 copies of 1024 tokens' logits over 8192.
    by_hand = 8192 * 12 * 64 * 768 + 3 * 1024 * 8192 * 4
    assert plan_memory(plan_inputs, H100).trainer_activations == by_hand
    # Checkpointed: a 768-wide bf16 hidden state per layer and token, plus one layer's 64 x 768.
    checkpointed = plan_memory(inputs_86m(gradient_checkpointing=True), H100).trainer_activations
    assert checkpointed == 8192 * (12 * 768 * 2 + 64 * 768) + 3 * 1024 * 8192 * 4
    fp32 = plan_memory(inputs_86m(compute_dtype_bytes=4), H100).trainer_activations
    assert fp32 == 2 * 8192 * 12 * 64 * 768 + 3 * 1024 * 8192 * 4


def _saved_for_backward(config, tokens: int, dtype) -> int:
    """Bytes of the tensors autograd keeps for backward in one forward of `config`'s decoder on `tokens` tokens
    (each storage once, the weights left out)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype).train()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(tensor):
        kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        model.get_decoder()(input_ids=torch.randint(0, config.vocab_size, (1, tokens)))
    return sum(size for pointer, size in kept.items() if pointer not in weights)


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "phi3"])
def test_the_activation_estimate_covers_what_autograd_keeps_per_layer(family):
    """Two layers more add at most what the plan counts for two layers, in bf16 and fp32: the plan's estimate
    is an upper bound on what `transformers`' own layers keep (the embeddings and head cancel out)."""
    import torch
    from transformers import GPT2Config, LlamaConfig, Phi3Config, Qwen3Config

    width, tokens = 128, 256
    common = dict(hidden_size=width, intermediate_size=344, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512)
    make = {"gpt2": lambda n: GPT2Config(n_layer=n, n_embd=width, n_head=4, vocab_size=512, resid_pdrop=0.0,
                                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
            "llama": lambda n: LlamaConfig(num_hidden_layers=n, **common),
            "qwen3": lambda n: Qwen3Config(num_hidden_layers=n, head_dim=32, **common),
            "phi3": lambda n: Phi3Config(num_hidden_layers=n, pad_token_id=0, **common)}[family]
    for dtype, dtype_bytes in ((torch.bfloat16, 2), (torch.float32, 4)):
        measured = _saved_for_backward(make(4), tokens, dtype) - _saved_for_backward(make(2), tokens, dtype)
        planned = [plan_memory(inputs_86m(policy=model_shape(make(layers), params=1), compute_dtype_bytes=dtype_bytes,
                                          max_tokens_per_device=tokens), H100).trainer_activations for layers in (2, 4)]
        assert 0 < measured <= planned[1] - planned[0], (family, dtype, measured, planned)
        if family in ACTIVATION_VALUES:  # a measured family's estimate is also close: no false out-of-memory warning
            assert planned[1] - planned[0] <= 1.25 * measured, (family, dtype, measured, planned)


def inputs_7b(**overrides) -> MemoryInputs:
    """Llama-2-7B with fp32 master weights and Adam under bf16 mixed precision, GRPO with a reference, a bf16
    engine; 256 sequences of 1024 + 512 tokens in flight."""
    settings = dict(policy=model_shape(llama_7b(), params=6_738_415_616), engine_dtype_bytes=2,
                    master_dtype_bytes=4, compute_dtype_bytes=2, trained_models=1, frozen_params=6_738_415_616,
                    sequences_in_flight=256, sequence_tokens=1536, min_kv_tokens=4096, max_tokens_per_device=8192,
                    logits_chunk=1024, engine_static_bytes=int(0.6 * H100.total_bytes))
    return MemoryInputs(**{**settings, **overrides})


def test_7b_llama_on_one_h100_does_not_fit_so_it_releases_and_says_the_trainer_alone_is_too_big():
    plan = plan_memory(inputs_7b(), H100)
    # 6.7e9 x (4 + 4 + 8) bytes = 108 GB before the reference and activations: more than the GPU.
    assert plan.trainer_params + plan.trainer_grads + plan.trainer_optimizer == 6_738_415_616 * 16
    assert not plan.fits and not plan.trainer_fits
    assert decide_release("auto", plan)
    assert plan.kv_tokens == 4096  # no room left: the pool keeps one sequence of the context
    assert "do not fit" in plan.reason and "capped by memory" in plan.reason


def test_7b_llama_on_eight_h100s_shards_the_trainer_but_still_releases_and_the_pool_is_capped():
    # Micro-batches of 4096 tokens: 8192 tokens of a 7B's activations, 64 GiB by the plan (44-60 measured per
    # family in test_the_activation_estimate_covers_what_autograd_keeps_per_layer), leave no room on an H100.
    plan = plan_memory(inputs_7b(dp_size=8, engines=8, max_tokens_per_device=4096), H100)
    assert plan.trainer_fits and not plan.fits and decide_release("auto", plan)
    # Each engine's share of 256 sequences, twice the fair share for the router: 64 x 1536 tokens of 512 KiB,
    # 48 GiB, more than SGLang's 0.6 of the GPU leaves after its 12.6 GiB of weights: the pool gets that much.
    assert plan.work_tokens == 64 * 1536
    assert plan.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2
    room = int(0.6 * H100.total_bytes) - 6_738_415_616 * 2
    assert plan.kv_tokens == room // plan.kv_bytes_per_token < plan.work_tokens


def test_released_memory_gives_the_pool_what_the_trainer_keeps_between_steps():
    # A 1.5B GQA model on one H100: the trainer at its peak is 35 GiB and the rollout's 512 x 2560 tokens of
    # 28 KiB another 35 GiB, so together they do not fit; released, the engine needs room only beside the
    # weights and optimizer states (22 GiB: no activations, no gradients), and the whole rollout fits there.
    shape = ModelShape(params=1_500_000_000, layers=28, hidden=1536, vocab=151936, kv_values_per_token=2 * 28 * 2 * 128)
    inputs = MemoryInputs(policy=shape, engine_dtype_bytes=2, master_dtype_bytes=4, compute_dtype_bytes=2,
                          dp_size=1, sequences_in_flight=512, sequence_tokens=2560, engines=1,
                          max_tokens_per_device=8192, logits_chunk=1024, min_kv_tokens=32768)
    plan = plan_memory(inputs, H100)
    assert plan.trainer_fits and not plan.fits and decide_release("auto", plan)
    assert plan.kv_tokens == plan.work_tokens == 512 * 2560
    between_steps = plan.trainer_params + plan.trainer_optimizer
    usable = H100.total_bytes - H100.reserve_bytes
    assert between_steps + plan.engine_total <= usable < plan.trainer_total + plan.engine_total


def test_modes_and_a_set_pool():
    fits = plan_memory(inputs_86m(), H100)
    too_big = plan_memory(inputs_7b(), H100)
    assert decide_release("always", fits) and not decide_release("never", too_big)
    assert decide_release("auto", too_big) and not decide_release("auto", fits)
    with pytest.raises(ValueError, match="sometimes"):
        decide_release("sometimes", fits)
    # A pool the user set is taken as it is, and judged with that size: 2M tokens of 36 KiB do not fit.
    assert plan_memory(inputs_86m(kv_tokens=5000), H100).kv_tokens == 5000
    assert not plan_memory(inputs_86m(kv_tokens=2_000_000), H100).fits


def test_a_device_too_small_for_both_gives_the_engine_what_is_left_beside_the_trainers_weights():
    # The 86M setting with its trainer at its peak (4.2 GiB) and a whole-batch pool (1 GiB) on a device whose
    # usable memory holds the trainer and the engine's weights but only part of that pool, even released.
    full = plan_memory(inputs_86m(engine_static_bytes=None), H100)
    between_steps = full.trainer_params + full.trainer_optimizer + full.trainer_frozen
    usable = full.trainer_total + full.engine_weights + full.engine_kv // 2
    # Device.of reserves 4 GiB + 5% of the device: solve for the device that leaves `usable`.
    device = Device(kind="cuda", total_bytes=usable + 4 * GIB, reserve_bytes=4 * GIB)
    plan = plan_memory(inputs_86m(engine_static_bytes=None), device)
    assert plan.trainer_fits and not plan.fits and decide_release("auto", plan)
    room = usable - between_steps - plan.engine_weights  # released: activations and gradients are gone
    assert plan.kv_tokens == min(plan.work_tokens, room // plan.kv_bytes_per_token)
    # the trainer's activations (2.5 GiB) outweigh the missing half pool: released, the whole batch fits
    assert plan.kv_tokens == plan.work_tokens


def test_cpu_device_is_the_machines_memory_shared_by_the_nodes_ranks():
    import torch

    mem_total_kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
    device = detect_device(torch.device("cpu"), ranks_on_node=2)
    assert device.kind == "cpu"
    assert abs(device.total_bytes - mem_total_kib * 1024 // 2) < 1 << 20
    assert device.reserve_bytes == GIB + int(0.05 * device.total_bytes)


def test_on_cpu_each_process_peak_is_its_parts_its_runtime_and_loading_the_policy_whole():
    from workers.memory_plan import PROCESS_RUNTIME_BYTES

    cpu = Device.of("cpu", 12 * GIB)
    plan = plan_memory(inputs_86m(engine_dtype_bytes=4, compute_dtype_bytes=4, dp_size=2), cpu)
    peaks = plan.process_peaks()
    assert peaks["trainer"] == plan.trainer_total + 2 * 92_133_888 * 4 + PROCESS_RUNTIME_BYTES
    assert peaks["engine"] == plan.engine_total + PROCESS_RUNTIME_BYTES
    assert plan.metrics()["memory_plan/trainer_process_gib"] == peaks["trainer"] / GIB
    assert "memory_plan/trainer_process_gib" not in plan_memory(inputs_86m(), H100).metrics()  # a GPU's is the allocator's
