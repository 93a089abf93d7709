"""docs/ builds with `mkdocs build --strict`; the configuration reference covers every key of the four
jobs with a description and is what scripts/config_reference.py writes today; the metrics reference is
what scripts/metrics_reference.py writes today; every `path/module.name` a page names exists; and the
algorithms page gives every loss aggregation, group baseline, rollout correction and KL estimator a formula."""

import functools
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.scripts import load_script

REPO = Path(__file__).resolve().parents[1]


@functools.lru_cache(maxsize=None)
def config_reference():
    return load_script("config_reference")


@functools.lru_cache(maxsize=None)
def metrics_reference():
    return load_script("metrics_reference")


def test_mkdocs_builds_the_site_strictly(tmp_path):
    assert importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material") \
        and importlib.util.find_spec("mkdocstrings_handlers.python"), \
        "mkdocs, mkdocs-material or mkdocstrings[python] is missing: pip install -e '.[dev]'"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "site" / "config-reference" / "index.html").is_file()
    assert (tmp_path / "site" / "metrics" / "index.html").is_file()
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="envs.base.Env"' in api and "Start a trajectory for one dataset row" in api  # docstrings rendered
    assert (tmp_path / "site" / "architecture.svg").is_file()


def test_every_config_key_of_every_job_has_a_description():
    missing = config_reference().undescribed()
    assert not missing, "keys without a description (write a comment next to the field):\n" + "\n".join(missing)


def test_the_config_reference_page_is_current():
    ref = config_reference()
    assert ref.OUTPUT.read_text() == ref.render(), \
        "docs/config-reference.md is stale: run python scripts/config_reference.py and commit it"


def test_the_config_reference_lists_every_key_with_type_and_default():
    ref = config_reference()
    page = ref.OUTPUT.read_text()
    for _, _, _, spec, _ in ref.JOBS:
        for _, _, keys in ref.keys_of(ref.load_schema(spec)):
            for key in keys:
                assert f"| `{key.key}` | " in page, f"{spec}: {key.key} is not in docs/config-reference.md"
                assert key.type and key.default, f"{spec}: {key.key} has no type or default"
    assert "| `async.max_staleness` |" in page and "| `async_" not in page  # users' spelling of the section


def test_the_metrics_reference_page_is_current():
    ref = metrics_reference()
    assert ref.OUTPUT.read_text() == ref.render(), \
        "docs/metrics.md is stale: run python scripts/metrics_reference.py and commit it"


# `rl_core/ppo/algorithms.compute_gae`, `rl_core/ppo/algorithms.AdaptiveKLController.update`, `envs/tools.py:Toolbox`
NAMED_ATTRIBUTE = re.compile(r"^((?:rl_core|workers|envs|offline)(?:/\w+)+?)(?:\.py:|\.)([A-Za-z_]\w*(?:\.\w+)*)$")


def test_every_function_class_or_constant_a_page_names_exists():
    """A page that names `path/module.name` names something the module has (tests/test_readme.py checks that
    the file exists, and every config key)."""
    from tests.test_readme import PAGES, code_spans

    problems = []
    for page in PAGES:
        for span in code_spans(page.read_text()):
            for token in span.split():
                token = token.strip("(),;")
                match = NAMED_ATTRIBUTE.match(token)
                if not match or (REPO / token).exists() or not (REPO / f"{match.group(1)}.py").is_file():
                    continue  # a file or a folder, which tests/test_readme.py checks
                target = importlib.import_module(match.group(1).replace("/", "."))
                for part in match.group(2).split("."):
                    target = getattr(target, part, None)
                if target is None:
                    problems.append(f"{page.name}: {match.group(1)} has no {match.group(2)}")
    assert not problems, "\n".join(problems)


def test_the_algorithms_page_gives_every_mode_its_formula():
    from rl_core.ppo.algorithms import GROUP_KINDS, KL_KINDS, LOSS_AGG_MODES, ROLLOUT_CORRECTIONS

    page = (REPO / "docs" / "algorithms.md").read_text()
    for mode in (*LOSS_AGG_MODES, *GROUP_KINDS, *ROLLOUT_CORRECTIONS):
        assert f"\\text{{{mode}:}}" in page, f"docs/algorithms.md has no formula for {mode}"
    for kind in KL_KINDS:
        assert f"k_{kind[1:]} &=" in page, f"docs/algorithms.md has no formula for the {kind} estimator"


def test_everything_the_api_page_shows_has_a_docstring_and_so_does_each_public_method():
    """mkdocstrings leaves out what has no docstring: an undocumented hook would be missing from docs/api.md."""
    import inspect

    page = (REPO / "docs" / "api.md").read_text()
    targets = re.findall(r"^::: ([\w.]+)$", page, re.M)
    assert len(targets) >= 20
    missing = []
    for target in targets:
        try:
            obj = importlib.import_module(target)  # a module shown whole
        except ModuleNotFoundError:
            module, _, name = target.rpartition(".")
            obj = getattr(importlib.import_module(module), name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.ismodule(obj)):
            continue  # a constant or an alias: its docstring is read from the source
        if not inspect.getdoc(obj):
            missing.append(target)
        if inspect.isclass(obj):
            missing += [f"{target}.{key}" for key, value in vars(obj).items()
                        if not key.startswith("_") and (inspect.isfunction(value) or isinstance(value, property))
                        and not value.__doc__]
    assert not missing, "write a docstring for: " + ", ".join(missing)
