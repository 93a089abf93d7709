"""The assets the repository ships: complete, current with the code that builds them, and
reproducible (a rebuild gives the same bytes; the full check is `scripts/bootstrap_assets.py --check`)."""

import json
import shutil

import pytest

from offline.assets import default_assets_root
from offline.prepare import SUMS_FILE, asset_digests, build_all


class WouldBuild(Exception):
    pass


def refuse_to_build(line: str) -> None:
    raise WouldBuild(line)  # every build logs before it starts, so this stops it at once


def test_the_shipped_assets_are_listed_intact_and_current_so_no_recipe_rebuilds_them(tmp_path):
    shipped_root = default_assets_root()
    shipped = json.loads((shipped_root / SUMS_FILE).read_text())
    assert {"tiny-gpt2/model.safetensors", "tiny-sentiment-rm/model.safetensors",
            "tiny-arithmetic/model.safetensors", "prompts/sentiment_train.jsonl",
            "arithmetic/eval.jsonl", "tiny-tools-arithmetic/model.safetensors", "tools-arithmetic/eval.jsonl",
            "tiny-vision-shapes/model.safetensors", "vision-shapes/eval.jsonl"} <= set(shipped)
    digests = asset_digests(shipped_root)
    changed = [name for name, digest in shipped.items() if digests.get(name) != digest]
    assert not changed, f"shipped assets differ from {SUMS_FILE}: {changed}"
    # A copy, so a stale marker makes this test fail instead of rebuilding the repository's files.
    copy = tmp_path / "assets"
    shutil.copytree(shipped_root, copy, ignore=shutil.ignore_patterns(".*"))
    try:
        build_all(copy, log=refuse_to_build)
    except WouldBuild as err:
        pytest.fail(f"the code's settings no longer match the shipped assets ({err}); rebuild and re-ship them "
                    "with `python scripts/bootstrap_assets.py --force --write-sums`")


@pytest.mark.timeout(600)
def test_a_rebuild_gives_the_same_bytes(tmp_path):
    quiet = lambda *_: None  # noqa: E731
    build_all(tmp_path / "first", log=quiet, small=True)
    build_all(tmp_path / "second", log=quiet, small=True)
    first, second = asset_digests(tmp_path / "first"), asset_digests(tmp_path / "second")
    assert len(first) >= 15 and any(name.endswith("model.safetensors") for name in first)
    assert first == second
