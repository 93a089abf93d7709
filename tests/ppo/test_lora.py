"""LoRA for the PPO actor: the engines serve the merged weights (the probe agrees with the trainer),
the reference is the actor with its adapters off, and the adapters alone are trained and exported."""

import json

import pytest
import torch

from tests.jobs import read_metrics
from tests.ppo.test_job import run_job

LORA = ["model.lora.rank=4", "model.lora.alpha=8", "model.lora.target_modules=[c_attn,c_proj,c_fc]"]


def test_merged_weights_equal_peft_merge_and_unload(tmp_path):
    from rl_core.config import LoraSettings
    from offline.assets import ensure_tiny_assets
    from workers.lora import merged_weights, with_lora
    from workers.loading import load_causal_lm

    model_dir = ensure_tiny_assets(root=tmp_path, small=True, log=lambda *_: None).model_dir
    settings = LoraSettings(rank=4, alpha=8.0, target_modules=["c_attn", "c_proj", "c_fc"])
    model = with_lora(load_causal_lm(str(model_dir)), settings)
    torch.manual_seed(0)
    with torch.no_grad():  # trained-looking adapters (PEFT starts B at zero, which would merge to nothing)
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0, 0.1)
    merged = dict(merged_weights(model, model.state_dict().items()))
    expected = model.merge_and_unload().state_dict()
    assert set(merged) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(merged[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    base = load_causal_lm(str(model_dir)).state_dict()
    adapted = [name for name in base if name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))]
    assert adapted and all(not torch.allclose(merged[name], base[name]) for name in adapted)  # deltas were merged


@pytest.mark.timeout(600)
def test_lora_actor_pushes_merged_weights_and_exports_its_adapter(small_job, tmp_path):
    run_dir = tmp_path / "lora"
    output = run_job(small_job, run_dir, *LORA, "model.lora.export=adapter", "trainer.total_episodes=24",
                     "trainer.save_every=3", "algorithm.lr=3e-3")
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The engines' logprobs after each push match the LoRA actor's: the merge is the trained model.
    assert all(r["weight_sync/probe_gap"] < 1e-4 for r in rows), [r["weight_sync/probe_gap"] for r in rows]
    # Step 1 samples from the initial actor, whose adapters are zero: the reference (adapters off) is the same
    # model, so the KL is float rounding only (pi_old is the engine's cached decode, the reference a full pass).
    assert abs(rows[0]["kl/mean"]) < 1e-5
    assert rows[-1]["kl/mean"] != 0.0  # trained adapters move the actor away from the reference
    final = run_dir / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["c_attn", "c_fc", "c_proj"]
    assert not (final / "model.safetensors").exists()  # the adapter alone, not the model
    assert "final model saved" in output and (run_dir / "checkpoints" / "step_00000003").is_dir()


@pytest.mark.timeout(600)
def test_a_lora_actor_trains_on_one_rank(small_job, tmp_path):
    """One rank keeps whole parameters gathered after each forward (workers/fsdp.py), except for a LoRA actor:
    with that, the second micro-batch of step 1 lost its adapters' gradients and the job stopped."""
    from tests.jobs import run_to_end
    from tests.ppo.test_job import torchrun_argv

    run_dir = tmp_path / "one_rank"
    overrides = small_job["overrides"] + [f"trainer.run_dir={run_dir}", *LORA, "trainer.total_episodes=16",
                                          "algorithm.max_tokens_per_device=64", "algorithm.lr=3e-3"]
    run_to_end(torchrun_argv(overrides, ranks=1), timeout=420)
    rows = [r for r in read_metrics(run_dir) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["kl/mean"] != 0.0 and all(r["policy/grad_norm"] > 0 for r in rows)
