"""Rank 0's endless, resumable stream of rollout samples (each prompt repeated `group_size` times)."""

from __future__ import annotations

from rl_core.data import PromptLoader, QueryProcessor, load_prompt_dataset


class PromptSamples:
    """Prompt batches as rollout samples. Queries go to the engine unpadded: with position ids
    from the exclusive cumsum of the mask, OpenAI's fixed-length left padding changes no logit,
    so padding happens only when micro-batches are collated."""

    def __init__(self, loader: PromptLoader, group_size: int, seed: int):
        self.loader, self.group_size, self.seed = loader, group_size, seed
        self.served = 0  # samples handed out so far: each gets its own engine sampling seed

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        samples = []
        for item in self.loader.next_batch():
            for _ in range(self.group_size):
                # A per-sample seed makes a resumed run sample what the uninterrupted run would have.
                seed = (self.seed * 1_000_003 + self.served * 7_919) % (2**31 - 1)
                samples.append({**item.row, "prompt_ids": item.query.unpadded_ids, "index": item.index,
                                "sampling_seed": seed})
                self.served += 1
        return samples

    def state_dict(self) -> dict:
        return {"loader": self.loader.state_dict(), "served": self.served}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.served = state["served"]


def prompt_samples(data_cfg, prompts_path: str, tokenizer, batch_size: int, group_size: int, seed: int) -> PromptSamples:
    """The PPO job's prompt stream from its `data` config section."""
    dataset = load_prompt_dataset(prompts_path, text_key=data_cfg.text_key, on_malformed=data_cfg.on_malformed)
    if dataset.skipped:
        print(f"skipped {dataset.skipped} malformed prompt rows in {dataset.source}")
    processor = QueryProcessor(tokenizer, data_cfg.query_length, data_cfg.start_text, data_cfg.end_text)
    loader = PromptLoader(dataset, batch_size // group_size, seed=seed, processor=processor)
    return PromptSamples(loader, group_size, seed)
