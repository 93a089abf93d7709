"""What the README and docs/ tell a user to run or read exists: commands, recipes, modules, config keys,
repository paths and the tests they name. The README keeps its three commands and the GPU quickstart on
its first screen, in at most 200 lines."""

import dataclasses
import importlib.util
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
FIRST_SCREEN = 60  # lines

# CI (.ci/run) and tests/test_readme.py hold these verbatim: a new user copies them.
THREE_COMMANDS = [
    "bash scripts/setup_env.sh && .venv/bin/torchrun --nproc_per_node 2 -m rl_core.train --config ppo_sentiment.yaml",
    "bash scripts/setup_env.sh && bash scripts/setup_sglang_cpu.sh && .venv/bin/python -m pytest -q tests",
    "bash scripts/setup_env.sh && .venv/bin/torchrun --nproc_per_node 2 -m rl_core.train --config grpo_arithmetic.yaml",
]
GPU_QUICKSTART = 'pip install -e ".[sglang]"'

SCHEMAS = {"rl_core.train": "rl_core.ppo.config:PPOConfig", "rl_core.train_sft": "rl_core.sft.config:SFTConfig",
           "rl_core.train_dpo": "rl_core.dpo.config:DPOConfig", "rl_core.train_rm": "rl_core.reward_model.config:RMConfig"}
REPO_DIRS = ("rl_core", "workers", "envs", "scripts", "tests", "configs", "assets", "docs", ".ci")
KEY = re.compile(r"^([a-z_]+(?:\.[a-z0-9_]+)+)(=.*)?$")
NOT_KEYS = {"model.generate"}  # transformers' method, named in benchmarks.md
FILE_SUFFIX = re.compile(r"\.(py|yaml|yml|json|jsonl|md|sh|log|txt|png|svg|parquet|csv)$")


def page_name(path: Path) -> str:
    return str(path.relative_to(REPO))


@lru_cache(maxsize=None)
def schema(spec: str) -> type:
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def key_exists(spec: str, key: str, section_too: bool = False) -> bool:
    """`key` (dotted, as users write it) names a field of the job's config, or lies inside a dict field
    (or with `section_too`, names a section)."""
    from rl_core.config import _KEY_ALIASES

    cls = schema(spec)
    parts = key.split(".")
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        f = fields.get(_KEY_ALIASES.get(part, part))
        if f is None:
            return False
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if dataclasses.is_dataclass(default):
            cls = type(default)
            if i == len(parts) - 1:
                return section_too
            continue
        return i == len(parts) - 1 or isinstance(default, dict)
    return False


def is_section(key: str) -> bool:
    first = key.split(".")[0]
    return any(first in {("async" if f.name == "async_" else f.name) for f in dataclasses.fields(schema(spec))}
               for spec in SCHEMAS.values())


def code_spans(text: str) -> list[str]:
    """Inline code outside fenced blocks."""
    outside = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return re.findall(r"`([^`\n]+)`", outside)


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.M | re.S)


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a page: its bash blocks and the inline code that starts like a command."""
    lines = []
    for block in fenced(text, "bash"):
        lines += block.replace("\\\n", " ").splitlines()
    lines += [span for span in code_spans(text)
              if re.match(r"(\.venv/bin/)?(python|torchrun|bash|rl-core|pip|pytest)\b", span)]
    commands = []
    for line in lines:
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            words = line.split()
        command: list[str] = []
        for word in words + ["&&"]:
            if word in ("&&", "||", "|", ";"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    return commands


def check_command(words: list[str]) -> list[str]:
    """Problems with one command: missing scripts, modules, recipes, config keys, test files."""
    from rl_core.config import ConfigError, resolve_config_path
    from rl_core.console import JOBS

    problems, job = [], None
    program = words[0].rsplit("/", 1)[-1]
    if program == "rl-core" and len(words) > 1:
        for command in words[1].split("|"):  # `rl-core sft|dpo|rm`: each of them
            if command not in (*JOBS, "plot", "export"):
                problems.append(f"rl-core has no command {command!r}")
        job = JOBS.get(words[1])
    for i, word in enumerate(words):
        previous = words[i - 1] if i else ""
        if previous == "-m":
            if importlib.util.find_spec(word) is None:
                problems.append(f"no module {word}")
            job = job or (word if word in SCHEMAS else None)
        elif previous == "--config" and not word.isupper():  # FILE: a placeholder
            try:
                resolve_config_path(word)
            except ConfigError:
                problems.append(f"no recipe {word}")
        elif word.startswith(tuple(d + "/" for d in REPO_DIRS)) and FILE_SUFFIX.search(word.split("::")[0]):
            if not (REPO / word.split("::")[0]).exists():
                problems.append(f"no file {word}")
    if job is not None:
        for word in words:
            match = KEY.match(word)
            if match and match.group(2) and not key_exists(SCHEMAS[job], match.group(1)):
                problems.append(f"{SCHEMAS[job]} has no key {match.group(1)}")
    return problems


def repo_path_exists(token: str) -> bool:
    """`rl_core/ppo/job.py`, `workers/forward._in_chunks`, `envs/arithmetic_tools.py:calc`, `tests/envs/`."""
    path = token.split("::")[0].split(":")[0].rstrip(".,;)")
    while True:
        if (REPO / path).exists() or (REPO / f"{path}.py").exists():
            return True
        head, _, tail = path.rpartition("/")
        if "." not in tail:
            return False
        path = f"{head}/{tail.rsplit('.', 1)[0]}"


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_command_names_scripts_modules_recipes_and_keys_that_exist(page):
    commands = shell_commands(page.read_text())
    problems = [f"{' '.join(c)}: {p}" for c in commands for p in check_command(c)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=page_name)
def test_every_config_key_path_and_test_a_page_names_exists(page):
    text = page.read_text()
    problems = []
    for span in code_spans(text):
        for token in span.split():
            token = token.strip("(),;")
            match = KEY.match(token)  # not inside quotes: an error message's misspelt key is quoted
            if match and not FILE_SUFFIX.search(match.group(1)) and is_section(match.group(1)) \
                    and match.group(1) not in NOT_KEYS:
                if not any(key_exists(spec, match.group(1), section_too=True) for spec in SCHEMAS.values()):
                    problems.append(f"no config key {match.group(1)}")
            token = token.strip("'\"")
            if token.startswith(tuple(d + "/" for d in REPO_DIRS)) and not repo_path_exists(token):
                problems.append(f"no file {token}")
        current = None
        for path, name in re.findall(r"(tests/[\w/]+\.py)?::(\w+)", span):
            current = path or current  # `::other` continues the previous file
            if current and not re.search(rf"^(async )?def {name}\(", (REPO / current).read_text(), re.M):
                problems.append(f"{current}::{name} is not a test")
    for block in fenced(text, "yaml"):
        import yaml

        def flat(tree, prefix=""):
            for k, v in tree.items():
                yield from flat(v, f"{prefix}{k}.") if isinstance(v, dict) and k not in ("fns", "kwargs") else [prefix + k]

        problems += [f"no config key {key}" for key in flat(yaml.safe_load(block))
                     if not any(key_exists(spec, key) for spec in SCHEMAS.values())]
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not target.startswith(("http://", "https://")) and not (page.parent / target).exists():
            problems.append(f"broken link {target}")
    assert not problems, "\n".join(problems)


def test_the_openai_details_table_names_tests_that_exist():
    table = (REPO / "docs" / "openai-details.md").read_text()
    named = []
    for row in table.splitlines():
        current = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?::(\w+)`", row):
            current = path or current  # `::other` continues the previous file
            named.append((current, name))
    assert len(named) >= 15
    for path, name in named:
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path}::{name} is not a test"


def test_the_readme_is_short_and_starts_with_install_first_run_and_the_gpu_quickstart():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"
    first_screen = "\n".join(lines[:FIRST_SCREEN])
    for command in THREE_COMMANDS + [GPU_QUICKSTART]:
        assert command in first_screen.splitlines(), f"not on the README's first screen: {command}"


def test_ci_runs_the_readmes_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/setup_env.sh" in ci and "bash scripts/setup_sglang_cpu.sh" in ci
    assert re.search(r"^\.venv/bin/python -m pytest -q .*tests$", ci, re.M)
