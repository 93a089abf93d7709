"""Prompt loading and validation, OpenAI query preprocessing, and the resumable prompt loader."""

import csv
import json

import pytest

from rl_core.data import PromptDataError, load_prompt_dataset
from rl_core.prompt_encoding import QueryProcessor
from rl_core.rollout.prompts import PromptLoader

TEXTS = ["The old man walked to the market.", "She smiled at the sun.", "It was a sad day."]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --- loading -------------------------------------------------------------------------------------


def test_every_supported_format_loads_the_same_prompts(tmp_path):
    import datasets

    rows = [{"text": text, "id": index} for index, text in enumerate(TEXTS)]
    files = [_write_jsonl(tmp_path / "p.jsonl", rows)]
    (tmp_path / "p.json").write_text(json.dumps(rows))
    files.append(tmp_path / "p.json")
    with open(tmp_path / "p.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=["text", "id"])
        writer.writeheader()
        writer.writerows(rows)
    files.append(tmp_path / "p.csv")
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "p.parquet"))
    files.append(tmp_path / "p.parquet")
    for path in files:
        dataset = load_prompt_dataset(path)
        assert dataset.texts() == TEXTS, path
        assert dataset[1]["id"] == 1 and dataset.skipped == 0


@pytest.mark.parametrize("bad_row, problem", [
    ({"other": "no text here"}, "missing 'text'"),
    ({"text": 42}, "int, not a string"),
    ({"text": "   "}, "is empty"),
])
def test_malformed_row_names_file_row_and_fix(tmp_path, bad_row, problem):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"text": TEXTS[0]}, {"text": TEXTS[1]}, bad_row])
    with pytest.raises(PromptDataError) as error:
        load_prompt_dataset(path)
    message = str(error.value)
    assert str(path) in message and "row 3" in message and problem in message
    assert "data.on_malformed=skip" in message  # the real config key


def test_bad_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"text": TEXTS[0]}) + "\n" + '{"text": "unclosed"\n'
                    + json.dumps({"text": TEXTS[1]}) + "\n")
    with pytest.raises(PromptDataError, match=r"p\.jsonl, line 2: invalid JSON"):
        load_prompt_dataset(path)


def test_skip_mode_drops_and_counts_every_kind_of_malformed_row(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [json.dumps({"text": TEXTS[0]}), '{"text": oops}', json.dumps({"text": 7}),
             json.dumps({"title": "x"}), json.dumps({"text": TEXTS[2]})]
    path.write_text("\n".join(lines) + "\n")
    dataset = load_prompt_dataset(path, on_malformed="skip")
    assert dataset.texts() == [TEXTS[0], TEXTS[2]]
    assert dataset.skipped == 3


def test_skip_mode_without_parse_errors_keeps_datasets_path(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"text": TEXTS[0]}, {"text": ""}, {"text": TEXTS[1]}])
    dataset = load_prompt_dataset(path, on_malformed="skip")
    assert dataset.texts() == TEXTS[:2] and dataset.skipped == 1


def test_empty_files_and_datasets_are_refused(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(PromptDataError, match="empty"):
        load_prompt_dataset(tmp_path / "empty.jsonl")
    (tmp_path / "header.csv").write_text("text\n")
    with pytest.raises(PromptDataError, match="no rows"):
        load_prompt_dataset(tmp_path / "header.csv")
    _write_jsonl(tmp_path / "all_bad.jsonl", [{"text": ""}, {"text": None}])
    with pytest.raises(PromptDataError, match="no usable prompt rows"):
        load_prompt_dataset(tmp_path / "all_bad.jsonl", on_malformed="skip")


def test_missing_file_and_unknown_field_are_explained(tmp_path):
    missing = tmp_path / "nowhere" / "prompts.jsonl"
    with pytest.raises(PromptDataError, match="does not exist") as error:
        load_prompt_dataset(missing)
    assert str(missing) in str(error.value)
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": TEXTS[0]}])
    with pytest.raises(PromptDataError, match=r"no 'text' field.*\['prompt'\]"):
        load_prompt_dataset(path)
    assert load_prompt_dataset(path, text_key="prompt").texts() == [TEXTS[0]]


def test_hub_name_while_offline_says_so(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PromptDataError, match="not an existing local file.*hub"):
        load_prompt_dataset("nobody/no-such-prompt-dataset")


def test_unsupported_extension_and_policy_are_refused(tmp_path):
    (tmp_path / "p.txt").write_text("hello\n")
    with pytest.raises(PromptDataError, match="unsupported extension"):
        load_prompt_dataset(tmp_path / "p.txt")
    with pytest.raises(PromptDataError, match="on_malformed"):
        load_prompt_dataset(tmp_path / "p.txt", on_malformed="ignore")


# --- query preprocessing ---------------------------------------------------------------------------


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_query_is_unpadded_and_truncated_to_query_length(tokenizer):
    text = "the dark room was cold and sad. " * 4
    ids = _ids(tokenizer, text)
    assert QueryProcessor(tokenizer, query_length=len(ids) + 5)(text) == ids  # padding is the collator's job
    assert QueryProcessor(tokenizer, query_length=5)(text) == ids[:5]
    assert QueryProcessor(tokenizer, query_length=5, truncate_side="left")(text) == ids[-5:]


def test_start_and_end_text_select_the_sentence_between(tokenizer):
    processor = QueryProcessor(tokenizer, query_length=64, start_text=".", end_text=".")
    assert processor("he laughed. she smiled at the sun. and then") == _ids(tokenizer, " she smiled at the sun.")
    # OpenAI truncates before looking for the last end_text.
    short = QueryProcessor(tokenizer, query_length=len(_ids(tokenizer, "a sad day. the cold")),
                           end_text=".")
    assert short("a sad day. the cold room. x") == _ids(tokenizer, "a sad day.")
    assert processor("no period anywhere") is None


def test_query_processor_refuses_a_tokenizer_whose_pad_is_eos(tokenizer):
    class PadIsEos:
        pad_token_id = tokenizer.eos_token_id
        eos_token_id = tokenizer.eos_token_id

    with pytest.raises(ValueError, match=r"\[PAD\]"):
        QueryProcessor(PadIsEos(), query_length=8)


# --- loader ----------------------------------------------------------------------------------------


def _rows(count):
    return [{"text": f"prompt number {index}."} for index in range(count)]


def _indices(loader, batches):
    return [[item.index for item in loader.next_batch()] for _ in range(batches)]


def test_loader_order_is_seeded_and_each_epoch_is_a_permutation():
    rows = _rows(12)
    first = _indices(PromptLoader(rows, batch_size=4, seed=3), 9)
    assert first == _indices(PromptLoader(rows, batch_size=4, seed=3), 9)
    assert first != _indices(PromptLoader(rows, batch_size=4, seed=4), 9)
    epochs = [sum(first[i:i + 3], []) for i in (0, 3, 6)]
    assert all(sorted(epoch) == list(range(12)) for epoch in epochs)
    assert epochs[0] != epochs[1]  # reshuffled every epoch


def test_loader_resumes_from_its_state_dict():
    rows = _rows(10)
    loader = PromptLoader(rows, batch_size=3, seed=7)
    _indices(loader, 5)  # crosses an epoch boundary mid-batch
    state = json.loads(json.dumps(loader.state_dict()))  # survives a JSON checkpoint
    expected = _indices(loader, 6)
    resumed = PromptLoader(rows, batch_size=3, seed=0)
    resumed.load_state_dict(state)
    assert _indices(resumed, 6) == expected
    assert resumed.epoch == loader.epoch
    with pytest.raises(PromptDataError, match="same prompt file"):
        PromptLoader(_rows(11), batch_size=3, seed=7).load_state_dict(state)


def test_loader_with_processor_skips_rows_without_a_query(tokenizer):
    rows = [{"text": "one. two."}, {"text": "no period"}, {"text": "three. four."}]
    processor = QueryProcessor(tokenizer, query_length=24, end_text=".")
    loader = PromptLoader(rows, batch_size=4, seed=1, encode=processor)
    batch = loader.next_batch()
    assert len(batch) == 4 and all(item.index != 1 for item in batch)
    assert all(item.prompt_ids == _ids(tokenizer, rows[item.index]["text"]) for item in batch)
    assert loader.skipped >= 1
    hopeless = PromptLoader([{"text": "no period"}], batch_size=1, seed=1, encode=processor)
    with pytest.raises(PromptDataError, match="no prompt yields a query"):
        hopeless.next_batch()


# --- chat prompts and the length rule ---------------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture()
def chat_tokenizer(tokenizer):
    import copy

    chat = copy.deepcopy(tokenizer)
    chat.chat_template = CHAT_TEMPLATE
    return chat


def test_chat_messages_are_rendered_with_the_tokenizers_template(tmp_path, chat_tokenizer):
    from rl_core.prompt_encoding import PromptEncoder

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "she smiled"}]
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages, "answer": "7"}])
    dataset = load_prompt_dataset(path, text_key=None)  # found under "messages"
    assert dataset.text_key == "messages" and dataset[0]["answer"] == "7"
    encode = PromptEncoder(chat_tokenizer, max_length=64)
    rendered = "<system>be brief<|endoftext|><user>she smiled<|endoftext|><assistant>"
    assert encode.render(dataset[0]["messages"]) == rendered
    assert encode(dataset[0]["messages"]) == _ids(chat_tokenizer, rendered)
    # plain text becomes one user turn (after the system prompt) when the chat template is asked for
    wrapped = PromptEncoder(chat_tokenizer, 64, chat_template=True, system_prompt="be brief")
    assert wrapped.render("she smiled") == rendered
    assert PromptEncoder(chat_tokenizer, 64).render("she smiled") == "she smiled"
    with pytest.raises(PromptDataError, match="no chat template"):
        PromptEncoder(tokenizer_without_template(chat_tokenizer), 64)(messages)
    with pytest.raises(PromptDataError, match="apply_chat_template=false"):
        PromptEncoder(chat_tokenizer, 64, chat_template=False)(messages)


def tokenizer_without_template(tokenizer):
    import copy

    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    return plain


def test_prompt_column_is_found_and_malformed_messages_are_named(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": TEXTS[0], "answer": 3}])
    assert load_prompt_dataset(path, text_key=None).text_key == "prompt"
    bad = _write_jsonl(tmp_path / "bad.jsonl", [{"messages": [{"role": "user"}]}])
    with pytest.raises(PromptDataError, match="row 1.*'role': str, 'content': str"):
        load_prompt_dataset(bad, text_key=None)
    none = _write_jsonl(tmp_path / "none.jsonl", [{"question": "x"}])
    with pytest.raises(PromptDataError, match="data.prompt_key"):
        load_prompt_dataset(none, text_key=None)


def test_long_prompts_are_skipped_and_counted_or_refused_never_cut(chat_tokenizer):
    from rl_core.prompt_encoding import PromptEncoder

    short, long = "she smiled.", "the old man walked to the market and felt happy. " * 4
    limit = len(_ids(chat_tokenizer, short)) + 2
    assert len(_ids(chat_tokenizer, long)) > limit
    rows = [{"text": short}, {"text": long}, {"text": long}]
    encode = PromptEncoder(chat_tokenizer, limit, on_long="skip")
    loader = PromptLoader(rows, batch_size=4, seed=1, encode=encode)
    batch = loader.next_batch()
    assert [item.index for item in batch] == [0, 0, 0, 0]  # only the short prompt, whole
    assert all(item.prompt_ids == _ids(chat_tokenizer, short) for item in batch)
    assert loader.skipped >= 6  # both long rows, every epoch
    with pytest.raises(PromptDataError, match="more than data.max_prompt_length"):
        PromptEncoder(chat_tokenizer, limit, on_long="error")(long)
    # OpenAI's query mode is the one that cuts, by explicit choice
    openai = PromptEncoder(chat_tokenizer, limit, on_long="truncate",
                           query_processor=QueryProcessor(chat_tokenizer, query_length=limit))
    assert openai(long) == _ids(chat_tokenizer, long)[:limit]


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv"])
def test_a_byte_that_is_not_utf8_names_file_line_and_fix(tmp_path, suffix):
    # 0xe9 is Latin-1's "é": the usual way such a byte gets into a file
    body = {".jsonl": b'{"text": "one."}\n{"text": "caf\xe9 two."}\n',
            ".json": b'[{"text": "one."},\n {"text": "caf\xe9 two."}]\n',
            ".csv": b'text\ncaf\xe9 two.\n'}[suffix]  # the header is line 1
    path = tmp_path / f"prompts{suffix}"
    path.write_bytes(body)
    with pytest.raises(PromptDataError) as caught:
        load_prompt_dataset(path)
    message = str(caught.value)
    assert message.startswith(f"{path}, line 2: byte 0xe9") and "not UTF-8" in message, message
    assert "save the file as UTF-8" in message and "\n" not in message


def test_chat_template_kwargs_reach_the_dataset_prompts_as_they_reach_the_envs_turns(tmp_path, chat_tokenizer):
    """env.chat_template_kwargs (a non-thinking Qwen3's enable_thinking: false) render the training and held-out
    prompts too: a first turn sampled from a prompt rendered without them would differ from every later one."""
    import copy

    from rl_core.ppo.config import DataConfig
    from rl_core.rollout.prompts import eval_samples, prompt_samples

    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = CHAT_TEMPLATE.replace("<assistant>{% endif %}",
                                              "<assistant>{% if not (enable_thinking | default(true)) %}<think></think>"
                                              "{% endif %}{% endif %}")
    path = _write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "she smiled"}]}] * 2)
    data = DataConfig(max_prompt_length=64)
    for kwargs, ending in (({}, "<assistant>"), ({"enable_thinking": False}, "<assistant><think></think>")):
        train = next(prompt_samples(data, str(path), tok, batch_size=2, group_size=1, seed=0, template_kwargs=kwargs))
        held_out, _ = eval_samples(data, str(path), tok, n=1, max_prompts=None, template_kwargs=kwargs)
        for sample in train + held_out:
            assert tok.decode(sample["prompt_ids"]).endswith(ending)


def test_on_long_prompt_error_is_checked_when_the_data_is_read_and_names_the_row(tmp_path, chat_tokenizer):
    # The PPO job reads its prompts before any engine starts: a long prompt must stop it there, not at
    # the step that first draws it (after the engines are up).
    from rl_core.ppo.config import DataConfig
    from rl_core.rollout.prompts import eval_samples, prompt_samples

    short, long = "she smiled.", "the old man walked to the market and felt happy. " * 4
    path = _write_jsonl(tmp_path / "prompts.jsonl", [{"text": short}] * 3 + [{"text": long}])
    data = DataConfig(max_prompt_length=len(_ids(chat_tokenizer, short)) + 2, on_long_prompt="error")
    expected = rf"^{path}, row 4: the prompt has \d+ tokens, more than data.max_prompt_length="
    with pytest.raises(PromptDataError, match=expected):
        prompt_samples(data, str(path), chat_tokenizer, batch_size=2, group_size=2, seed=0)
    with pytest.raises(PromptDataError, match=expected):
        eval_samples(data, str(path), chat_tokenizer, n=1, max_prompts=None)


def test_prompt_samples_are_seeded_one_seed_each_or_not_at_all(tmp_path, chat_tokenizer):
    from rl_core.ppo.config import DataConfig
    from rl_core.rollout.prompts import prompt_samples

    path = _write_jsonl(tmp_path / "prompts.jsonl", [{"text": t} for t in ("she smiled.", "he laughed.")])
    data = DataConfig(max_prompt_length=32)
    seeded = next(prompt_samples(data, str(path), chat_tokenizer, batch_size=4, group_size=2, seed=0))
    unseeded = next(prompt_samples(data, str(path), chat_tokenizer, batch_size=4, group_size=2, seed=0, seeded=False))
    assert len({s["sampling_seed"] for s in seeded}) == 4
    assert not any("sampling_seed" in s for s in unseeded)
    assert [s["prompt_ids"] for s in unseeded] == [s["prompt_ids"] for s in seeded]
