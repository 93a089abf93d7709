"""SFT rows: which tokens are trained, and one clear line for rows the job cannot use."""

import json
from types import SimpleNamespace

import pytest

from rl_core.sft.data import SFTDataError, encode_messages, encode_prompt_response, encode_rows
from offline.arithmetic import CHAT_TEMPLATE
from workers.loading import load_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def data_cfg(**overrides):
    cfg = dict(format="auto", messages_key="messages", prompt_key="prompt", response_key="response",
               max_length=512, on_long="drop", chat_template_kwargs={})
    return SimpleNamespace(**{**cfg, **overrides})


def trained_text(tokenizer, ids, mask):
    return [tokenizer.decode([i for i, m in zip(ids, mask) if m == 1])]


def test_only_assistant_turns_are_trained_and_the_pieces_tokenize_on_their_own(chat_tokenizer):
    tok = chat_tokenizer
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "one plus one?"},
            {"role": "assistant", "content": "two"}, {"role": "user", "content": "and two more?"},
            {"role": "assistant", "content": "four"}]
    ids, mask = encode_messages(tok, chat)
    assert len(ids) == len(mask)
    # The whole conversation as the template renders it, token for token.
    assert tok.decode(ids) == tok.apply_chat_template(chat, tokenize=False)
    runs, current = [], []
    for token, trained in zip(ids, mask):
        if trained:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    runs.append(tok.decode(current)) if current else None
    eos = tok.eos_token
    assert runs == [f" two{eos}\n", f" four{eos}\n"]  # after "Assistant:", up to the end of the turn
    # The prompt part is exactly what the RL jobs render as the prompt of the first turn.
    first = mask.index(1)
    assert tok.decode(ids[:first]) == tok.apply_chat_template(chat[:2], add_generation_prompt=True, tokenize=False)


def test_prompt_response_rows_train_the_response_and_end_with_eos(chat_tokenizer):
    tok = chat_tokenizer
    ids, mask = encode_prompt_response(tok, "the old man", " walked home")
    assert mask == [0] * len(tok("the old man")["input_ids"]) + [1] * (len(tok(" walked home")["input_ids"]) + 1)
    assert ids[-1] == tok.eos_token_id
    chat_ids, chat_mask = encode_prompt_response(tok, [{"role": "user", "content": "hi"}], " hello")
    assert tok.decode(chat_ids[:chat_mask.index(1)]) == "User: hi\nAssistant:"


def test_rows_the_job_cannot_use_are_named(chat_tokenizer, tiny_model_dir):
    with pytest.raises(SFTDataError, match="cannot tell the SFT format.*data.format"):
        encode_rows([{"text": "a"}], chat_tokenizer, data_cfg(), "rows.jsonl")
    with pytest.raises(SFTDataError, match="rows.jsonl row 2: a conversation has no assistant turn"):
        encode_rows([{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
                     {"messages": [{"role": "user", "content": "a"}]}], chat_tokenizer, data_cfg(), "rows.jsonl")
    plain = load_tokenizer(tiny_model_dir)
    plain.chat_template = None
    with pytest.raises(SFTDataError, match="no chat template.*model.tokenizer_path"):
        encode_messages(plain, [{"role": "assistant", "content": "b"}])


def test_long_rows_are_dropped_or_cut_and_counted(chat_tokenizer):
    rows = [{"prompt": "a b c d e f g h", "response": " i j k l m n o p"}, {"prompt": "a", "response": " b"}]
    length = len(encode_prompt_response(chat_tokenizer, rows[0]["prompt"], rows[0]["response"])[0])
    kept, too_long = encode_rows(rows, chat_tokenizer, data_cfg(max_length=length - 3), "rows.jsonl")
    assert too_long == 1 and len(kept) == 1
    cut, too_long = encode_rows(rows, chat_tokenizer, data_cfg(max_length=length - 3, on_long="truncate"), "rows.jsonl")
    assert too_long == 1 and len(cut) == 2 and len(cut[0].input_ids) == length - 3
    with pytest.raises(SFTDataError, match="no row fits data.max_length=2"):
        encode_rows(rows[:1], chat_tokenizer, data_cfg(max_length=2), "rows.jsonl")


def test_chat_template_kwargs_reach_every_rendering_of_a_row(chat_tokenizer):
    """data.chat_template_kwargs (e.g. a non-thinking Qwen3's enable_thinking: false) in the prompt before each
    trained turn and in the turn itself, for both row formats."""
    import copy

    tok = copy.deepcopy(chat_tokenizer)
    quiet = "{{ 'Assistant:' ~ (' [quiet]' if quiet else '') }}"  # the kwarg shows where each assistant turn starts
    tok.chat_template = CHAT_TEMPLATE.replace("{{ 'Assistant: ' }}", quiet + "{{ ' ' }}").replace("{{ 'Assistant:' }}", quiet)
    assert tok.chat_template.count("[quiet]") == 2
    chat = [{"role": "user", "content": "one plus one?"}, {"role": "assistant", "content": "two"}]
    rows = [{"messages": chat}, {"prompt": chat[:1], "response": " two"}]
    for kwargs, shown in (({}, False), ({"quiet": True}, True)):
        (messages_row,), _ = encode_rows(rows[:1], tok, data_cfg(chat_template_kwargs=kwargs), "rows.jsonl")
        (prompt_row,), _ = encode_rows(rows[1:], tok, data_cfg(chat_template_kwargs=kwargs), "rows.jsonl")
        for example in (messages_row, prompt_row):
            prompt = tok.decode(example.input_ids[:example.loss_mask.index(1)])
            assert ("[quiet]" in prompt) == shown and prompt.endswith(" [quiet]" if shown else "Assistant:")
        assert tok.decode(messages_row.input_ids) == tok.apply_chat_template(chat, tokenize=False, **kwargs)


@pytest.mark.parametrize("layout", ["rows", "one_row"])
def test_packed_rows_give_the_padded_loss_and_gradients(tiny_model_dir, layout):
    """Back to back with positions restarting and attention kept inside each sequence (rows with a
    block-diagonal mask, or flash-attention's one row, here through sdpa): the same log-likelihood and
    gradients as padded rows, to 1e-5 in fp32, with no padding at all."""
    import torch

    from rl_core.sft.data import SFTExample
    from rl_core.sft.training import collate, token_sums
    from workers.layout import laid_out
    from workers.loading import load_causal_lm

    generator = torch.Generator().manual_seed(0)
    examples = []
    for length in (5, 17, 9, 30, 2, 12):
        ids = torch.randint(3, 250, (length,), generator=generator).tolist()
        mask = [0] * (length // 3) + [1] * (length - length // 3)
        examples.append(SFTExample(ids, mask, {}))
    model = load_causal_lm(tiny_model_dir)
    results = []
    for packing in (None, layout):
        model.zero_grad()
        batch = laid_out(collate(examples, pad_token_id=0), packing)
        nll, correct, count = token_sums(model, batch)
        nll.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        grid = batch["packed_input_ids" if packing else "input_ids"].numel()
        results.append((float(nll.detach()), float(correct), float(count), grads, grid))
    (padded_nll, padded_correct, padded_count, padded_grads, padded_grid), (nll, correct, count, grads, grid) = results
    assert grid < padded_grid and int((batch["packed_segment_ids"] >= 0).sum()) == sum(len(e.input_ids) for e in examples)
    assert count == padded_count and correct == padded_correct
    assert nll == pytest.approx(padded_nll, rel=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, padded_grads[name], rtol=1e-5, atol=1e-6), name


def test_a_byte_that_is_not_utf8_names_file_and_line(tmp_path):
    from rl_core.sft.data import load_rows

    path = tmp_path / "sft.jsonl"
    path.write_bytes(b'{"prompt": "1+1=", "response": "2"}\n{"prompt": "caf\xe9", "response": "x"}\n')
    with pytest.raises(SFTDataError, match=rf"^{path}, line 2: byte 0xe9 .*not UTF-8.*save the file as UTF-8"):
        load_rows(str(path), "data.train_path")


def test_rows_are_read_from_every_file_kind_and_a_missing_file_names_its_key(tmp_path):
    import csv

    import datasets

    from rl_core.sft.data import load_rows

    rows = [{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2=", "response": "4"}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "sft.json").write_text(json.dumps(rows))
    with open(tmp_path / "sft.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["prompt", "response"])
        writer.writeheader()
        writer.writerows(rows)
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "sft.parquet"))
    for name in ("sft.jsonl", "sft.json", "sft.csv", "sft.parquet"):
        assert load_rows(str(tmp_path / name), "data.train_path") == rows, name
    with pytest.raises(SFTDataError, match=r"SFT data file .*nowhere\.jsonl does not exist .*check data\.eval_path$"):
        load_rows(str(tmp_path / "nowhere.jsonl"), "data.eval_path")
