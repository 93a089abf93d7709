"""Model paths are checked before anything loads: one line naming the key, what is wrong and the fix."""

import time

import pytest

from workers.loading import ModelPathError, check_model_path


def test_a_local_model_directory_passes(tiny_model_dir):
    check_model_path(tiny_model_dir, "model.path")


@pytest.mark.parametrize("make_path, problem", [
    (lambda tmp: "/nonexistent/model", "does not exist (resolved to /nonexistent/model)"),
    (lambda tmp: str(tmp / "missing" / "deeper"), "does not exist"),
    (lambda tmp: "./not/here", "does not exist"),
    (lambda tmp: str(tmp), "has no config.json, so it is not a Hugging Face model directory"),
    (lambda tmp: str(tmp / "weights.bin"), "is a file, not a model directory"),
    (lambda tmp: "someone/not-cached-model", "not a model on the Hugging Face hub (HF_HUB_OFFLINE=1"),
])
def test_a_bad_path_fails_fast_in_one_line_naming_the_key(tmp_path, monkeypatch, make_path, problem):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # as in CI: no network
    (tmp_path / "weights.bin").write_bytes(b"\0")
    path = make_path(tmp_path)
    started = time.monotonic()
    with pytest.raises(ModelPathError) as error:
        check_model_path(path, "reward.model_path")
    message = str(error.value)
    assert time.monotonic() - started < 2  # no hub retries
    assert message.startswith(f"reward.model_path={path} ") and problem in message and "\n" not in message
    assert "config.json" in message  # the fix names what a model directory holds


def test_a_tokenizer_directory_needs_no_config(tmp_path):
    check_model_path(str(tmp_path), "model.tokenizer_path", need_config=False)
