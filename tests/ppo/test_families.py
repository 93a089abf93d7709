"""Every model family users train (offline/families.py) through the arithmetic GRPO recipe, as a user
runs it: torchrun, one step, on real SGLang (1 rank) and, for the families whose parameters the sharded
trainer meets differently, on the embedded engine (2 CPU ranks).

Each family is a tiny random model built here from its `transformers` config with the recipe's chat
tokenizer. The engine must serve exactly the trainer's weights after every push: the initial one and the
trained step's (the job itself stops at a probe gap of 1e-3 or more, and the logged gap is checked too; a
second step would push the same tensors by the same code once more), and `final/` must load back as
the same family. Sliding-window families get a window shorter than their sequences, so the window is
really applied in rollout, training and the probe (21 tokens).

On SGLang one rank, so one server start per family: a server's start (~30 s of CPU, most of a case's time
on 2 cores) is what the family changes nothing in, while what the family does change, the pushed tensors
landing in SGLang's model class and its logprobs, is the same from one rank as from each of two. The
2-rank push into SGLang (gather, a server per rank, the same control calls as the embedded engine) is
tests/ppo/test_job_sglang.py's; each family's 2-rank job is the embedded case here.

    python -m pytest tests/ppo/test_families.py
"""

import json
import time

import pytest

from offline.families import FAMILIES, save_family_model
from tests.jobs import read_metrics, run_to_end
from tests.ppo.test_job import torchrun_argv, wait_gone
from tests.sglang_env import ENGINE_KINDS, require_sglang_python

# Prompts of about 30 tokens + 20 generated: a window of 16 is crossed by every sequence, while
# the model's CONTEXT positions hold them with room to spare.
SLIDING_WINDOW = 16
WINDOWED = {"mistral", "gemma2", "gemma3"}  # the families whose configs use `sliding_window` by default
CONTEXT = 512
MAX_GAP = 1e-3  # float32 on both sides: a correct push leaves rounding error only
# SGLang 0.5.23 runs Mistral as Llama (its MistralForCausalLM is LlamaForCausalLM), without the sliding
# window: past it the engine's logprobs are not the trainer's (a gap of 0.0039 at the first push with a
# window of 16), so the job refuses a Mistral on SGLang whose window its sequences cross
# (`check_sglang_serves_the_window`; tests/test_config.py) and this test gives it a window they stay within.
SGLANG_WINDOWS = {"mistral": CONTEXT}
# The embedded engine serves every family with transformers' own class, so its 2-rank job adds most where the
# sharded trainer meets a family's own parameters (q/k norms, experts, tied and soft-capped heads, fused qkv) and
# Llama as the plain case; Qwen2 and Mistral are Llama's layout there (their forwards, windows included, are
# tests/workers/test_family_forward.py's). On SGLang each family is its own model class: every family runs.
EMBEDDED_FAMILIES = {"llama", "qwen3", "qwen3_moe", "phi3", "gemma2", "gemma3"}
CASES = [(family, engine) for family in FAMILIES for engine in ENGINE_KINDS
         if engine == "sglang" or family in EMBEDDED_FAMILIES]


@pytest.fixture(scope="module")
def arithmetic():
    """The shipped chat tokenizer and problems (built on first use if missing)."""
    from offline.arithmetic import ensure_arithmetic_assets

    return ensure_arithmetic_assets(log=lambda *_: None)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family, engine", CASES)
def test_a_grpo_step_keeps_engine_and_trainer_equal_and_exports_the_family(arithmetic, tmp_path, family, engine):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    engine_overrides = ["rollout.engine=sglang", f"rollout.sglang_python={require_sglang_python()}"] \
        if engine == "sglang" else []
    window = {"sliding_window": SLIDING_WINDOW} if family in WINDOWED else {}
    if engine == "sglang" and family in SGLANG_WINDOWS:
        window = {"sliding_window": SGLANG_WINDOWS[family]}
    model_dir = save_family_model(family, arithmetic.model_dir, tmp_path / "model", max_position_embeddings=CONTEXT,
                                  **window)
    run_dir = tmp_path / "run"
    started = time.monotonic()
    run_to_end(torchrun_argv([
        f"model.path={model_dir}", f"data.train_path={arithmetic.train_file}", "data.eval_path=null",
        "eval.every=0", "algorithm.batch_size=16", "algorithm.group_size=4", "env.num_envs=8",
        "trainer.total_episodes=16", "trainer.progress=false", f"trainer.run_dir={run_dir}",
        f"rollout.weight_check_tolerance={MAX_GAP}", *engine_overrides], config="grpo_arithmetic.yaml",
        ranks=1 if engine == "sglang" else 2),
        timeout=600 if engine == "sglang" else 300)
    metrics = read_metrics(run_dir)
    gaps = [m["weight_sync/probe_gap"] for m in metrics]
    print(json.dumps({"family": family, "engine": engine, "seconds": round(time.monotonic() - started, 1),
                      "probe_gaps": gaps}))
    assert [m["step"] for m in metrics] == [1]
    assert all(0 <= gap < MAX_GAP for gap in gaps), gaps  # the first push (version 0) is held by the tolerance
    if engine == "sglang":  # the job asked for the model's whole context, and SGLang serves it
        log = (run_dir / "logs" / "engine-rank0.log").read_text()
        assert f"'context_length': {CONTEXT}," in log and f"context_len={CONTEXT}," in log
        assert "crash diagnostics" not in log  # the job's stop is no crash: no 5 s wait for a py-spy dump
    # The window was really crossed: every logged prompt alone is longer than it.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and min(len(tokenizer(s["query"]).input_ids) for s in samples) > SLIDING_WINDOW
    final = AutoModelForCausalLM.from_pretrained(run_dir / "final")
    built = AutoConfig.from_pretrained(model_dir)
    assert final.config.model_type == built.model_type
    assert getattr(final.config, "sliding_window", None) == getattr(built, "sliding_window", None)
    if family in WINDOWED:
        assert final.config.sliding_window == window["sliding_window"]
    assert wait_gone(str(tmp_path)) == []
