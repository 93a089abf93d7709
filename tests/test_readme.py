"""The README's table of OpenAI details names tests that exist."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_every_test_the_readme_names_exists():
    table = REPO.joinpath("README.md").read_text().split("## OpenAI `lm-human-preferences` details", 1)[1]
    named = []
    for row in table.split("\n## ", 1)[0].splitlines():
        current = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", row):
            current = path or current  # `::other` continues the previous file
            named.append((current, name))
    assert len(named) >= 15
    for path, name in named:
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path}::{name} is not a test"
