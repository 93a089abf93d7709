"""Preference files: the three formats load from jsonl/json/csv/parquet, bad rows are named."""

import csv
import json

import pytest

from rl_core.preferences import (
    DEFAULT_MARGIN_MAP,
    PreferenceDataError,
    detect_format,
    load_preference_dataset,
    tokenize_preferences,
)


def write_jsonl(path, rows, blank_line_after=None):
    with open(path, "w") as handle:
        for i, row in enumerate(rows):
            handle.write(json.dumps(row) + "\n")
            if blank_line_after == i:
                handle.write("\n")
    return path


def write_csv(path, rows):
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_parquet(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return path


LLAMA2_ROWS = [
    {"prompt": "How do I boil an egg?", "response_1": "Put it in water.", "response_2": "No.",
     "chosen_response": 1, "prefer_degree": "significantly better",
     "response_1_safe": "yes", "response_2_safe": "yes", "safer_response": 1},
    {"prompt": "Tell me a joke.", "response_1": "I can't.", "response_2": "Why did the chicken...",
     "chosen_response": 2, "prefer_degree": "slightly better",
     "response_1_safe": "yes", "response_2_safe": "no", "safer_response": 1},
    {"prompt": "Say hi.", "response_1": "hi", "response_2": "hello",
     "chosen_response": 2, "prefer_degree": "negligibly better/unsure",
     "response_1_safe": "yes", "response_2_safe": "yes", "safer_response": 2},
]

OPENAI_ROWS = [
    {"query": f"query {i}", **{f"sample{k}": f"continuation {i}.{k}" for k in range(4)},
     "best": i % 4}
    for i in range(5)
]


def test_pairwise_jsonl_loads(tmp_path):
    rows = [{"prompt": f"p{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(3)]
    examples, skipped = load_preference_dataset(write_jsonl(tmp_path / "pairs.jsonl", rows))
    assert skipped == 0
    assert [(e.prompt, e.responses, e.best, e.margin) for e in examples] == [
        (f"p{i}", [f"good {i}", f"bad {i}"], 0, 0.0) for i in range(3)]


def test_pairwise_json_array_loads(tmp_path):
    path = tmp_path / "pairs.json"
    path.write_text(json.dumps([{"prompt": "p", "chosen": "a", "rejected": "b"}]))
    examples, _ = load_preference_dataset(path, format="pairwise")
    assert examples[0].responses == ["a", "b"]


def test_llama2_csv_loads_with_safety_and_without_margins_by_default(tmp_path):
    examples, skipped = load_preference_dataset(write_csv(tmp_path / "l2.csv", LLAMA2_ROWS))
    assert skipped == 0
    assert [e.best for e in examples] == [0, 1, 1]
    assert [e.margin for e in examples] == [0.0, 0.0, 0.0]
    assert examples[1].responses_safe == (True, False)
    assert [e.safer for e in examples] == [0, 0, 1]


def test_llama2_margin_map_sets_margins(tmp_path):
    path = write_jsonl(tmp_path / "l2.jsonl", LLAMA2_ROWS)
    examples, _ = load_preference_dataset(path, margin_map=DEFAULT_MARGIN_MAP)
    assert [e.margin for e in examples] == [3.0, 1.0, 0.0]
    custom = {"Significantly Better": 0.9, "better": 0.6, "slightly better": 0.3,
              "negligibly better or unsure": 0.05}
    examples, _ = load_preference_dataset(path, margin_map=custom)
    assert [e.margin for e in examples] == [0.9, 0.3, 0.05]


def test_csv_keeps_numeric_looking_text_as_text(tmp_path):
    rows = [{"prompt": "count", "chosen": "123", "rejected": "NA"}]
    examples, _ = load_preference_dataset(write_csv(tmp_path / "p.csv", rows))
    assert examples[0].responses == ["123", "NA"]


def test_openai_parquet_loads(tmp_path):
    examples, skipped = load_preference_dataset(write_parquet(tmp_path / "oa.parquet", OPENAI_ROWS))
    assert skipped == 0
    assert [e.best for e in examples] == [0, 1, 2, 3, 0]
    assert examples[2].responses == [f"continuation 2.{k}" for k in range(4)]
    assert examples[2].prompt == "query 2"


def test_detect_format_from_columns():
    assert detect_format(["prompt", "chosen", "rejected", "id"]) == "pairwise"
    assert detect_format(["prompt", "response_1", "response_2", "chosen_response"]) == "llama2"
    assert detect_format(["query", "sample0", "sample1", "best"]) == "openai"


def test_mixed_columns_error_lists_each_format(tmp_path):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b", "response_1": "c"}]
    with pytest.raises(PreferenceDataError) as err:
        load_preference_dataset(write_jsonl(tmp_path / "mixed.jsonl", rows))
    message = str(err.value)
    assert "mixes columns" in message and "pairwise" in message and "llama2" in message
    assert "query, sample0" in message  # the expected columns of every format are listed


def test_unknown_columns_error_lists_expected_columns(tmp_path):
    rows = [{"question": "p", "answer": "a"}]
    with pytest.raises(PreferenceDataError) as err:
        load_preference_dataset(write_jsonl(tmp_path / "unknown.jsonl", rows))
    message = str(err.value)
    for expected in ("prompt, chosen, rejected", "chosen_response", "sample0"):
        assert expected in message


def test_explicit_format_reports_missing_columns(tmp_path):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"}]
    with pytest.raises(PreferenceDataError, match=r"lacks column\(s\) \['response_1'"):
        load_preference_dataset(write_jsonl(tmp_path / "p.jsonl", rows), format="llama2")


@pytest.mark.parametrize("bad_row, problem", [
    ({"chosen_response": 3}, "'chosen_response' must be one of [1, 2], got 3"),
    ({"chosen_response": None}, "'chosen_response' is missing"),
    ({"prefer_degree": "way better"}, "'prefer_degree' 'way better' is unknown"),
    ({"response_2": ""}, "'response_2' is empty"),
    ({"response_1": 7}, "'response_1' must be a string, got int"),
    ({"response_1_safe": "maybe"}, "'response_1_safe' must be 'yes' or 'no'"),
])
def test_malformed_llama2_row_names_file_and_row(tmp_path, bad_row, problem):
    rows = [dict(r) for r in LLAMA2_ROWS]
    rows[1].update(bad_row)
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(PreferenceDataError) as err:
        load_preference_dataset(path)
    message = str(err.value)
    assert f"{path}: row 2 (line 2): {problem}" in message
    assert "row 1" not in message and "row 3" not in message
    assert "data.on_malformed=skip" in message  # the real config key


def test_row_numbers_in_csv_and_jsonl_lines_with_blank_lines(tmp_path):
    rows = [{"prompt": "p", "chosen": "a", "rejected": "b"} for _ in range(4)]
    rows[3]["rejected"] = ""
    csv_path = write_csv(tmp_path / "p.csv", rows)
    with pytest.raises(PreferenceDataError, match=r"p\.csv: row 4: 'rejected' is empty"):
        load_preference_dataset(csv_path)
    jsonl_path = write_jsonl(tmp_path / "p.jsonl", rows, blank_line_after=0)
    with pytest.raises(PreferenceDataError, match=r"row 4 \(line 5\): 'rejected' is empty"):
        load_preference_dataset(jsonl_path)


def test_openai_best_out_of_range(tmp_path):
    rows = [dict(r) for r in OPENAI_ROWS]
    rows[4]["best"] = 4
    with pytest.raises(PreferenceDataError, match=r"row 5 \(line 5\): 'best' must be one of "
                                                  r"\[0, 1, 2, 3\], got 4"):
        load_preference_dataset(write_jsonl(tmp_path / "oa.jsonl", rows))


def test_skip_mode_drops_and_counts_bad_rows(tmp_path):
    rows = [dict(r) for r in OPENAI_ROWS]
    rows[0]["best"] = -1
    rows[3]["sample2"] = "   "
    examples, skipped = load_preference_dataset(write_jsonl(tmp_path / "oa.jsonl", rows),
                                                on_malformed="skip")
    assert skipped == 2
    assert [e.prompt for e in examples] == ["query 1", "query 2", "query 4"]


def test_skip_mode_with_every_row_bad_is_an_error(tmp_path):
    rows = [{"prompt": "p", "chosen": "", "rejected": "b"}]
    with pytest.raises(PreferenceDataError, match="every row"):
        load_preference_dataset(write_jsonl(tmp_path / "p.jsonl", rows), on_malformed="skip")


def test_margins_enabled_require_prefer_degree(tmp_path):
    rows = [dict(r) for r in LLAMA2_ROWS]
    rows[0]["prefer_degree"] = None
    path = write_jsonl(tmp_path / "l2.jsonl", rows)
    assert load_preference_dataset(path)[0][0].margin == 0.0  # margins off: degree optional
    with pytest.raises(PreferenceDataError, match="row 1 .*margins are enabled"):
        load_preference_dataset(path, margin_map=DEFAULT_MARGIN_MAP)


def test_bad_arguments_are_explained(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    with pytest.raises(PreferenceDataError, match="format='sft' is unknown"):
        load_preference_dataset(path, format="sft")
    with pytest.raises(PreferenceDataError, match="does not exist"):
        load_preference_dataset(tmp_path / "missing.jsonl")
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(PreferenceDataError, match="unsupported extension"):
        load_preference_dataset(tmp_path / "p.txt")
    with pytest.raises(PreferenceDataError, match="finite number"):
        load_preference_dataset(path, margin_map={"better": float("nan")})


def test_a_hub_dataset_name_while_offline_is_one_line_naming_the_key(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(PreferenceDataError, match=r"'nobody/no-such-preferences' is not an existing local file, "
                                                  r"and loading it from the Hugging Face hub failed .*set data\.test_path"):
        load_preference_dataset("nobody/no-such-preferences", key="data.test_path")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_tokenize_concatenates_separately_tokenized_ids(tmp_path, tokenizer):
    rows = [{"prompt": "the old man walked", "chosen": " to the market", "rejected": "ed home"}]
    examples, _ = load_preference_dataset(write_jsonl(tmp_path / "p.jsonl", rows))
    [row] = tokenize_preferences(examples, tokenizer, max_length=64)
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert row.prompt_length == len(ids("the old man walked"))
    assert row.input_ids == [ids("the old man walked") + ids(" to the market"),
                             ids("the old man walked") + ids("ed home")]
    assert row.best == 0 and row.margin == 0.0


def test_tokenize_truncates_responses_and_rejects_long_prompts(tmp_path, tokenizer):
    rows = [{"prompt": "she smiled", "chosen": " at the bright morning sun " * 5,
             "rejected": " sad"}]
    examples, _ = load_preference_dataset(write_jsonl(tmp_path / "p.jsonl", rows))
    prompt_len = len(tokenizer("she smiled", add_special_tokens=False)["input_ids"])
    [row] = tokenize_preferences(examples, tokenizer, max_length=prompt_len + 3)
    assert len(row.input_ids[0]) == prompt_len + 3
    assert len(row.input_ids[1]) <= prompt_len + 3
    with pytest.raises(ValueError, match="example 0: the prompt alone is"):
        tokenize_preferences(examples, tokenizer, max_length=prompt_len)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_byte_that_is_not_utf8_names_file_and_line(tmp_path, suffix):
    body = {".jsonl": b'{"prompt": "p", "chosen": "a", "rejected": "b"}\n'
                      b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n',
            ".csv": b'prompt,chosen,rejected\np,a,b\ncaf\xe9,a,b\n'}[suffix]
    path = tmp_path / f"prefs{suffix}"
    path.write_bytes(body)
    line = 2 if suffix == ".jsonl" else 3
    with pytest.raises(PreferenceDataError) as caught:
        load_preference_dataset(path)
    message = str(caught.value)
    assert message.startswith(f"{path}, line {line}: byte 0xe9") and "save the file as UTF-8" in message, message
