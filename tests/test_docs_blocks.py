"""Every ```python block of README.md and docs/*.md runs on its own, as a reader copies
it: in a fresh Python process, in an empty temporary folder, on the CPU, within
``TIMEOUT_S``. A block that is a fragment (it uses the reader's own model, optimizer or
loop) is tagged ```py instead: it is not run, and the site shows it as a fragment
(``docs/_hooks/fragments.py``).

The blocks run in parallel subprocesses, started together by one fixture (as many at a
time as there are CPUs), so the whole check costs about the slowest blocks, not their sum.
A block that imports a package that is not installed (an extra) is skipped, naming it.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from _frameworks import refusal
from emakit._engine.compiled import refusal as compile_refusal

# the fixture that runs every block counts toward the first test's time
pytestmark = pytest.mark.timeout(1800)

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# per block: a few seconds on 2 idle cores, over 2 minutes for some at load average 18
TIMEOUT_S = 300
FENCE = re.compile(
    r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<code>.*?)^(?P=indent)```", re.M | re.S
)


def blocks(lang: str) -> list[tuple[str, str]]:
    """``(page:line, code)`` of each fenced block in ``lang``, indentation removed."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for m in FENCE.finditer(text):
            if m.group("lang") != lang:
                continue
            indent = len(m.group("indent"))
            code = "".join(line[indent:] for line in m.group("code").splitlines(keepends=True))
            line = text.count("\n", 0, m.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", code))
    return found


BLOCKS = blocks("python")


def missing_imports(code: str) -> list[str]:
    """Top-level packages the block imports that are not installed here."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return sorted(n for n in names if importlib.util.find_spec(n) is None)


def refused_imports(code: str) -> list[str]:
    """Why packages the block imports do not work with this torch (`_frameworks.refusal`),
    or why emakit refuses a keyword the block passes (``compile_update=True``)."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    reasons = {r for n in names if (r := refusal(n)) is not None}
    if "compile_update=True" in code and (why := compile_refusal()) is not None:
        reasons.add(why)  # emakit refuses it on this torch, by design
    return sorted(reasons)


def _run(code: str, folder: Path) -> tuple[int, str, float]:
    folder.mkdir(parents=True)
    script = folder.parent / f"{folder.name}.py"
    # No block may raise a PostHocWarning (a warning filter, set before the block runs:
    # ``python -W error::emakit.posthoc.PostHocWarning`` is refused at startup, "invalid
    # module name", and Python then runs without it)
    header = (
        "import warnings; from emakit.posthoc import PostHocWarning; "
        'warnings.simplefilter("error", PostHocWarning)\n'
    )
    script.write_text(header + code.replace("/tmp/", f"{folder}/"), encoding="utf-8")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src")}
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return -1, f"did not finish within {TIMEOUT_S} s", TIMEOUT_S
    return proc.returncode, proc.stdout[-2000:] + proc.stderr[-4000:], time.monotonic() - start


@pytest.fixture(scope="module")
def results(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[int, str, float]]:
    """Runs every selected, runnable block at once; ``{id: (returncode, output, seconds)}``."""
    wanted = {
        item.callspec.id
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_block_runs" and hasattr(item, "callspec")
    }
    todo = [
        (i, c)
        for i, c in BLOCKS
        if i in wanted and not missing_imports(c) and not refused_imports(c)
    ]
    base = tmp_path_factory.mktemp("blocks")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        futures = {i: pool.submit(_run, c, base / re.sub(r"\W", "_", i)) for i, c in todo}
        return {i: f.result() for i, f in futures.items()}


def test_pages_have_blocks() -> None:
    assert len(BLOCKS) >= 15, [i for i, _ in BLOCKS]  # the parser finds them
    assert any(i.startswith("README.md") for i, _ in BLOCKS)  # the quickstart
    assert any(i.startswith("docs/recipes.md") for i, _ in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[i for i, _ in BLOCKS])
def test_block_runs(block: tuple[str, str], results: dict[str, tuple[int, str, float]]) -> None:
    name, code = block
    missing = missing_imports(code)
    if missing:
        pytest.skip(f"{name} imports {missing}, not installed here")
    refused = refused_imports(code)
    if refused:
        pytest.skip(f"{name}: {'; '.join(refused)}")
    returncode, output, _ = results[name]
    assert returncode == 0, f"{name} failed on its own (```py marks a fragment):\n{output}"


def test_fragments_are_marked_on_the_site() -> None:
    """```py blocks are shown as fragments: the hook that titles them is in mkdocs.yml."""
    assert "docs/_hooks/fragments.py" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert blocks("py"), "no fragment left: drop the hook, or keep this test honest"


def test_a_block_that_raises_a_posthoc_warning_fails(tmp_path):
    # the promise above is checked: a PostHocWarning in a block is an error, not a line
    code = 'import warnings\nfrom emakit.posthoc import PostHocWarning\nwarnings.warn("x", PostHocWarning)\n'
    rc, out, _ = _run(code, tmp_path / "warns")
    assert rc != 0 and "PostHocWarning" in out
    rc, out, _ = _run('import warnings\nwarnings.warn("fine")\n', tmp_path / "other")
    assert rc == 0, out
