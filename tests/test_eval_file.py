"""A run folder's ``emakit-eval.json`` is data, never code (docs/security.md).

``emakit sweep FOLDER`` without ``--eval`` scores with the evaluation the folder's file
names, looked up in a fixed registry (`emakit.posthoc.evaluations.EVALUATIONS`) with typed,
range-checked keywords. The attacks below come from the security review of issue 38: each
named a function of emakit's that imported the folder's own code or overwrote a file. Every
one must end with exit code 2 and one line, before anything runs; and a walk over every
callable reachable from ``emakit.*`` proves that none but the registry's can be named.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import json
import os
import pkgutil
import re
import sys
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch
from click.testing import CliRunner

import emakit
from emakit import PostHocEMA
from emakit.demo.settings import SEED_RANGE, TEST_FRACTION_RANGE
from emakit.demo.training import held_out_loss
from emakit.errors import EMAStateError
from emakit.posthoc import evaluations
from emakit.posthoc.commands import load_function, sweep_cmd
from emakit.posthoc.evaluations import (
    EVAL_FILE_NAME,
    EVALUATIONS,
    MAX_EVAL_FILE_BYTES,
    find_eval_file,
    read_eval_file,
    write_eval_file,
)

DEMO = "emakit.demo.training:held_out_loss"


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder as a download would hold it: snapshots in a subfolder."""
    run = tmp_path_factory.mktemp("run")
    net = torch.nn.Linear(4, 2)
    ema = PostHocEMA(
        net,
        sigma_rels=(0.05, 0.28),
        checkpoint_every_num_steps=10,
        checkpoint_folder=run / "posthoc-snapshots",
    )
    for _ in range(30):
        net.weight.data.add_(0.01)
        ema.update()
    return run


def sweep(folder: Path, cwd: Path) -> Any:
    """``emakit sweep FOLDER`` without ``--eval``, from ``cwd``."""
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return CliRunner().invoke(sweep_cmd, [str(folder), "--sigma-rel", "0.1"])
    finally:
        os.chdir(old)


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error")]


def runner() -> CliRunner:
    """A runner keeping stderr apart from stdout (click >= 8.2 always does; before it,
    ``mix_stderr=False``, which click 8.2 removed, asks for it)."""
    try:
        return CliRunner(mix_stderr=False)  # type: ignore[call-arg]
    except TypeError:
        return CliRunner()


# What the review wrote into downloaded folders (issue 38), and what else a file may hold.
ATTACKS: dict[str, Any] = {
    "imports the folder's package": {
        "eval": "emakit.posthoc.commands:load_function",
        "kwargs": {"param": None, "spec": "run1:x"},
    },
    "overwrites a file": {
        "eval": "emakit.checkpoint:save_checkpoint",
        "kwargs": {"path": "VICTIM"},
    },
    "runs the command line": {"eval": "emakit.cli:main", "kwargs": {}},
    "names a module outside emakit": {"eval": "os:getcwd"},
    "a prefix without the dot": {"eval": "emakitx.evil:run"},
    "the registry's module, another function": {"eval": "emakit.demo.training:train"},
    "the registry's name with a suffix": {"eval": DEMO + "x"},
    "the registry's name as a dotted path": {"eval": "emakit.demo.training.held_out_loss"},
    "a keyword the function does not declare": {"eval": DEMO, "kwargs": {"state_dict": 1}},
    "a bool seed": {"eval": DEMO, "kwargs": {"seed": True}},
    "a float seed": {"eval": DEMO, "kwargs": {"seed": 1.0}},
    "a negative seed": {"eval": DEMO, "kwargs": {"seed": -1}},
    "a seed past scikit-learn's range": {"eval": DEMO, "kwargs": {"seed": SEED_RANGE[1] + 1}},
    "a string fraction": {"eval": DEMO, "kwargs": {"test_fraction": "0.3"}},
    "a fraction of 0": {"eval": DEMO, "kwargs": {"test_fraction": 0.0}},
    "a fraction of 1": {"eval": DEMO, "kwargs": {"test_fraction": 1}},
    "kwargs as a list": {"eval": DEMO, "kwargs": [1]},
    "eval as a number": {"eval": 5},
    "eval as a list": {"eval": [DEMO]},
    "no eval": {"kwargs": {}},
    "an extra key": {"eval": DEMO, "kwargs": {}, "module": "os"},
    "a list at the top": [DEMO],
}
RAW_ATTACKS: dict[str, bytes] = {
    "nested 100,000 deep": b"[" * 100_000 + b"]" * 100_000,
    "nested objects 100,000 deep": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    "NaN": b'{"eval": "' + DEMO.encode() + b'", "kwargs": {"test_fraction": NaN}}',
    "Infinity": b'{"eval": "' + DEMO.encode() + b'", "kwargs": {"seed": Infinity}}',
    "a duplicate key": b'{"eval": "' + DEMO.encode() + b'", "eval": "emakit.cli:main"}',
    "not UTF-8": b'{"eval": "\xff\xfe"}',
    "truncated": b'{"eval": "' + DEMO.encode(),
    "empty": b"",
    "over the size limit": b'{"eval": "' + DEMO.encode() + b'"}' + b" " * MAX_EVAL_FILE_BYTES,
}


@pytest.mark.parametrize("case", [*ATTACKS, *RAW_ATTACKS])
def test_a_hostile_eval_file_is_refused_in_one_line_before_anything_runs(
    run_folder: Path, tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    package = run_folder / "run1"  # what load_function("run1:x") would import from the cwd
    package.mkdir(exist_ok=True)
    marker = tmp_path / "ran"
    (package / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nx = 1\n")
    if case in ATTACKS:
        text = json.dumps(ATTACKS[case]).replace("VICTIM", str(victim))
        (run_folder / EVAL_FILE_NAME).write_text(text)
    else:
        (run_folder / EVAL_FILE_NAME).write_bytes(RAW_ATTACKS[case])
    monkeypatch.setattr(sys, "path", list(sys.path))
    path_before, modules_before = list(sys.path), set(sys.modules)
    try:
        result = sweep(run_folder, cwd=run_folder)
    finally:
        (run_folder / EVAL_FILE_NAME).unlink()
    assert result.exit_code == 2, result.output
    (line,) = errors(result.output)
    assert f"{run_folder / EVAL_FILE_NAME} is not a usable {EVAL_FILE_NAME}: " in line
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert not marker.exists() and "run1" not in sys.modules
    assert victim.read_text() == "mine"
    assert sys.path == path_before
    for name in set(sys.modules) - modules_before:  # emakit's own readers, none of the folder
        where = str(getattr(sys.modules[name], "__file__", None) or "")
        assert not where.startswith((str(run_folder), str(tmp_path))), name
    assert "sigma_rel" not in result.output  # no length was synthesized or scored


def test_refusals_name_the_entry_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / EVAL_FILE_NAME
    cases = {
        "emakit.cli:main": (
            "\"eval\" is 'emakit.cli:main', which is not one of emakit's",
            "--eval",
        ),
    }
    for name, (says, fix) in cases.items():
        path.write_text(json.dumps({"eval": name}))
        with pytest.raises(EMAStateError) as info:
            read_eval_file(path)
        assert says in str(info.value) and fix in str(info.value)
        assert DEMO in str(info.value)  # what may be named
    path.write_text(json.dumps({"eval": DEMO, "kwargs": {"state_dict": 1}}))
    with pytest.raises(EMAStateError, match=r"entry 'state_dict' is not a keyword of .*seed"):
        read_eval_file(path)
    path.write_text(json.dumps({"eval": DEMO, "kwargs": {"seed": -1}}))
    with pytest.raises(EMAStateError, match=r"entry 'seed': seed must be >= 0, got seed=-1"):
        read_eval_file(path)
    path.write_text(json.dumps({"eval": DEMO, "kwargs": {"test_fraction": 0.999}}))
    with pytest.raises(EMAStateError, match=r"test_fraction must be .*\[0.01, 0.99\]"):
        read_eval_file(path)
    path.write_text('{"eval": "x", "eval": "y"}')
    with pytest.raises(EMAStateError, match="'eval' appears more than once"):
        read_eval_file(path)
    for constant in ("NaN", "Infinity", "-Infinity"):
        path.write_text(f'{{"eval": "{DEMO}", "kwargs": {{"test_fraction": {constant}}}}}')
        with pytest.raises(EMAStateError, match=f": {constant} is not a number JSON allows$"):
            read_eval_file(path)
    path.write_text(json.dumps({"eval": "a" * 1000}))
    with pytest.raises(EMAStateError) as info:
        read_eval_file(path)
    # a long value is cut, the message stays one line
    assert len(str(info.value)) - len(str(path)) < 330 and "\n" not in str(info.value)
    structure = {
        json.dumps({"eval": DEMO, "kwargs": [1]}): r'"kwargs" must be a JSON object, got \[1\]$',
        "[7]": r'it must hold a JSON object with "eval", got \[7\]$',
        json.dumps({"eval": DEMO, "x": 1}): r"the key 'x' is not one of \['eval', 'kwargs'\]$",
        json.dumps({"kwargs": {}}): 'it has no "eval" naming the evaluation$',
    }
    for text, says in structure.items():
        path.write_text(text)
        with pytest.raises(EMAStateError, match=f"^{re.escape(str(path))} is not a usable "):
            read_eval_file(path)
        with pytest.raises(EMAStateError, match=says):
            read_eval_file(path)


@pytest.mark.parametrize(("length", "cut"), [(80, False), (81, True)])
def test_values_up_to_80_characters_are_shown_whole(tmp_path: Path, length: int, cut: bool):
    path = tmp_path / EVAL_FILE_NAME
    value = "a" * (length - 2)  # its repr: length characters
    path.write_text(json.dumps({"eval": value}))
    with pytest.raises(EMAStateError) as info:
        read_eval_file(path)
    shown = repr(value)[:77] + "..." if cut else repr(value)
    assert f'"eval" is {shown}, which is not one of' in str(info.value)


def test_a_file_of_exactly_the_size_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / EVAL_FILE_NAME
    text = json.dumps({"eval": DEMO})
    path.write_text(text + " " * (MAX_EVAL_FILE_BYTES - len(text)))
    assert read_eval_file(path)[0] == DEMO
    path.write_text(text + " " * (MAX_EVAL_FILE_BYTES - len(text) + 1))
    with pytest.raises(EMAStateError, match=f"it is larger than {MAX_EVAL_FILE_BYTES} bytes$"):
        read_eval_file(path)


def test_a_large_file_is_read_no_further_than_the_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hostile file of any size costs one bounded read: the limit and one byte more."""
    path = tmp_path / EVAL_FILE_NAME
    path.write_bytes(b" " * (3 * MAX_EVAL_FILE_BYTES))
    sizes = []
    opened = evaluations.open_regular

    def recording(*args: Any, **kwargs: Any) -> Any:
        f = opened(*args, **kwargs)
        read = f.read
        f.read = lambda n=-1: sizes.append(n) or read(n)  # type: ignore[method-assign]
        return f

    monkeypatch.setattr(evaluations, "open_regular", recording)
    with pytest.raises(EMAStateError, match="larger than"):
        read_eval_file(path)
    assert sizes == [MAX_EVAL_FILE_BYTES + 1]


def test_a_fifo_or_a_folder_named_like_the_file_is_refused(run_folder: Path) -> None:
    path = run_folder / EVAL_FILE_NAME
    path.mkdir()
    try:
        result = sweep(run_folder, cwd=run_folder)
        assert result.exit_code == 2 and len(errors(result.output)) == 1
        assert f"{EVAL_FILE_NAME} must be a regular file, got path=" in result.output
        assert "which is a folder" in result.output
    finally:
        path.rmdir()
    if hasattr(os, "mkfifo"):
        os.mkfifo(path)
        try:
            result = sweep(run_folder, cwd=run_folder)  # returns: a FIFO is never opened
            assert result.exit_code == 2 and "FIFO" in result.output
        finally:
            path.unlink()


def test_the_registry_entry_binds_the_files_keywords(tmp_path: Path) -> None:
    write_eval_file(tmp_path, DEMO, seed=7, test_fraction=0.25)
    assert json.loads((tmp_path / EVAL_FILE_NAME).read_text()) == {
        "eval": DEMO,
        "kwargs": {"seed": 7, "test_fraction": 0.25},
    }
    assert (tmp_path / EVAL_FILE_NAME).read_text() == (  # for a reader: indented, one key a line
        f'{{\n  "eval": "{DEMO}",\n  "kwargs": {{\n    "seed": 7,\n    "test_fraction": 0.25\n'
        f"  }}\n}}\n"
    )
    name, score = read_eval_file(tmp_path / EVAL_FILE_NAME)
    assert name == DEMO and isinstance(score, functools.partial)
    assert score.func is held_out_loss and score.keywords == {"seed": 7, "test_fraction": 0.25}
    (tmp_path / EVAL_FILE_NAME).write_text(json.dumps({"eval": DEMO}))  # defaults apply
    assert read_eval_file(tmp_path / EVAL_FILE_NAME)[1].keywords == {}
    for low, high in (SEED_RANGE, TEST_FRACTION_RANGE):  # both ends are taken
        assert low < high
    write_eval_file(tmp_path, DEMO, seed=SEED_RANGE[1], test_fraction=TEST_FRACTION_RANGE[0])
    assert read_eval_file(tmp_path / EVAL_FILE_NAME)[1].keywords["seed"] == SEED_RANGE[1]
    write_eval_file(tmp_path, DEMO, seed=SEED_RANGE[0], test_fraction=TEST_FRACTION_RANGE[1])
    assert read_eval_file(tmp_path / EVAL_FILE_NAME)[1].keywords["test_fraction"] == 0.99


def test_the_writer_refuses_what_the_reader_would(tmp_path: Path) -> None:
    with pytest.raises(EMAStateError, match="not one of emakit's evaluations"):
        write_eval_file(tmp_path, "emakit.cli:main")
    with pytest.raises(EMAStateError, match="seed must be an int"):
        write_eval_file(tmp_path, DEMO, seed=0.5)
    with pytest.raises(EMAStateError, match="not a keyword"):
        write_eval_file(tmp_path, DEMO, path="x")
    assert not (tmp_path / EVAL_FILE_NAME).exists()


def test_the_folders_own_file_wins_over_its_parents(tmp_path: Path) -> None:
    inner = tmp_path / "posthoc-snapshots"
    inner.mkdir()
    assert find_eval_file(inner) is None
    write_eval_file(tmp_path, DEMO, seed=1)
    assert find_eval_file(inner) == tmp_path / EVAL_FILE_NAME
    write_eval_file(inner, DEMO, seed=2)
    assert find_eval_file(inner) == inner / EVAL_FILE_NAME
    assert read_eval_file(find_eval_file(inner))[1].keywords == {"seed": 2}
    (inner / EVAL_FILE_NAME).write_text('{"eval": "emakit.cli:main"}')  # no fall-through
    with pytest.raises(EMAStateError):
        read_eval_file(find_eval_file(inner))


@pytest.mark.filterwarnings("ignore::emakit.posthoc.math.PostHocWarning")  # a short run
def test_sweep_scores_with_the_registry_entry(run_folder: Path, monkeypatch) -> None:
    """The demo's entry reaches the sweep with its keywords (its model is not this
    folder's, so the call is stubbed at the registry)."""
    calls: list[dict[str, Any]] = []

    def fake(state_dict: Any, **kwargs: Any) -> float:
        calls.append(kwargs)
        return 1.0

    entry = dataclasses.replace(EVALUATIONS[DEMO], load=lambda: fake)
    monkeypatch.setattr(evaluations, "EVALUATIONS", MappingProxyType({DEMO: entry}))
    write_eval_file(run_folder, DEMO, seed=3, test_fraction=0.5)
    monkeypatch.chdir(run_folder)
    try:
        args = [str(run_folder / "posthoc-snapshots"), "--sigma-rel", "0.1"]
        result = runner().invoke(sweep_cmd, args)
    finally:
        (run_folder / EVAL_FILE_NAME).unlink()
    assert result.exit_code == 0, result.stderr
    assert calls == [{"seed": 3, "test_fraction": 0.5}]
    note = f"Note: scoring with {DEMO} from {run_folder / EVAL_FILE_NAME}\n"
    assert note in result.stderr and "Note" not in result.stdout  # stdout: the results alone
    assert "best: sigma_rel=0.1" in result.stdout


def _reachable_names() -> set[str]:
    """``module:name`` and ``module:Class.method`` for every callable reachable from
    every module of emakit (the form the old resolver took, and more)."""
    names: set[str] = set()
    modules, refused = [emakit], []
    for m in pkgutil.walk_packages(emakit.__path__, "emakit."):
        if m.name == "emakit.__main__":
            continue
        try:
            modules.append(importlib.import_module(m.name))
        except ImportError as e:  # a drop-in or integration whose framework is not installed
            refused.append(str(e))
    assert all("pip install" in e for e in refused), refused  # its own message, saying what to do
    assert len(modules) > 40, modules  # the walk found emakit's modules
    for module in modules:
        for attr, value in vars(module).items():
            if not callable(value):
                continue
            names.add(f"{module.__name__}:{attr}")
            if inspect.isclass(value):
                for member, inner in vars(value).items():
                    if callable(inner) or isinstance(inner, (staticmethod, classmethod)):
                        names.add(f"{module.__name__}:{attr}.{member}")
    return names


def test_no_callable_of_emakit_but_the_registrys_can_be_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    names = _reachable_names()
    dangerous = {
        "emakit.posthoc.commands:load_function",
        "emakit.checkpoint:save_checkpoint",
        "emakit.cli:main",
        "emakit.demo.training:train",
    }
    assert dangerous <= names and len(names) > 1000  # the walk is not vacuous
    imported: list[str] = []
    real_import = importlib.import_module

    def spy(name: str, package: str | None = None) -> Any:
        imported.append(name)
        return real_import(name, package)

    monkeypatch.setattr(importlib, "import_module", spy)
    path = tmp_path / EVAL_FILE_NAME
    modules_before = set(sys.modules)
    reached: set[str] = set()
    refusals: list[str] = []
    for name in sorted(names):
        path.write_text(json.dumps({"eval": name}))
        try:
            reached.add(read_eval_file(path)[0])
        except EMAStateError as e:
            refusals.append(str(e))
    assert all("which is not one of emakit's evaluations" in r for r in refusals)
    assert len(refusals) == len(names) - 1
    assert reached == set(EVALUATIONS) & names == {DEMO}
    assert imported == [] and set(sys.modules) == modules_before


def test_eval_on_the_command_line_cannot_shadow_installed_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--eval`` is the user's choice; the current folder is searched after the installed
    packages, so a downloaded folder's ``json.py`` never stands in for the real one."""
    (tmp_path / "myeval.py").write_text("def score(sd):\n    return 0.5\n")
    (tmp_path / "emakit_shadow_probe.py").write_text("")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.chdir(tmp_path)
    fn = load_function(None, None, "myeval:score")
    assert fn({}) == 0.5
    assert sys.path[-1] == str(tmp_path) and sys.path[0] != str(tmp_path)
    monkeypatch.delitem(sys.modules, "myeval")


def test_held_out_loss_is_the_demos_score(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    from emakit.demo.training import make_model

    torch.manual_seed(0)
    state = make_model().state_dict()
    write_eval_file(tmp_path, DEMO, seed=0, test_fraction=0.3)
    _, score = read_eval_file(tmp_path / EVAL_FILE_NAME)
    assert score(state) == held_out_loss(state, seed=0, test_fraction=0.3)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("score", "expected module:function, got 'score'"),
        (":score", "expected module:function, got ':score'"),
        ("sweep_probe:", "expected module:function, got 'sweep_probe:'"),
        ("sweep_probe:score:x", "'sweep_probe' has no function 'score:x'"),  # the first colon
        ("sweep_probe:missing", "'sweep_probe' has no function 'missing'"),
        (
            "emakit_no_such_module:score",
            "cannot import 'emakit_no_such_module': No module named 'emakit_no_such_module'",
        ),
    ],
)
def test_a_bad_eval_option_is_a_usage_error_naming_the_option(
    spec: str, says: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--eval`` that names no function: click's usage error for the option (exit code 2,
    the usage and one line on stderr), before the folder is read."""
    (tmp_path / "sweep_probe.py").write_text("def score(sd):\n    return 0.5\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # --eval appends the current folder
    monkeypatch.chdir(tmp_path)
    try:
        result = runner().invoke(
            sweep_cmd, ["missing-folder", "--sigma-rel", "0.1", "--eval", spec]
        )
    finally:
        sys.modules.pop("sweep_probe", None)
    assert result.exit_code == 2, (result.exception, result.stderr)
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == f"Error: Invalid value for '--eval': {says}"
    assert result.stderr.startswith("Usage: sweep [OPTIONS] FOLDER\n")
