"""The documentation site (mkdocs, material theme, mkdocstrings) builds with --strict:
no broken link, no docstring the API reference cannot parse, no page left out of the nav."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_site_builds_strict(tmp_path: Path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    api = (tmp_path / "api" / "emakit" / "index.html").read_text(encoding="utf-8")
    # the reference is generated from the docstrings: a keyword only EMA's docstring has
    assert "ema_dtype" in api
    posthoc = (tmp_path / "api" / "posthoc" / "index.html").read_text(encoding="utf-8")
    for name in ("list_snapshots", "read_snapshot_info", "find_snapshot_folder"):
        assert name in posthoc
    for page in ("demo", "examples", "development", "posthoc", "architecture"):
        assert (tmp_path / page / "index.html").is_file()
    # a ```py block is titled as a fragment (docs/_hooks/fragments.py); a ```python one not
    resume = (tmp_path / "resume" / "index.html").read_text(encoding="utf-8")
    assert "Fragment: uses your own model" in resume
    index = (tmp_path / "index.html").read_text(encoding="utf-8")
    assert "Fragment: uses your own model" not in index


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_raw_sphinx_roles_in_the_source():
    """mkdocstrings renders Markdown: a ``:class:`X``` would show as literal text.
    ``python tools/convert_roles.py`` rewrites them (the strict build fails on them too)."""
    roles = _tool("convert_roles")
    left = [
        f"{path.relative_to(ROOT)}:{line}: {role}"
        for path in sorted((ROOT / "src" / "emakit").rglob("*.py"))
        for line, role in roles.find_roles(path.read_text(encoding="utf-8"))
    ]
    assert not left, f"{len(left)} raw roles (python tools/convert_roles.py):\n" + "\n".join(
        left[:20]
    )


def test_the_docs_build_fails_on_a_raw_role(caplog):
    """The mkdocs hook logs a warning per raw role on a page, which --strict makes fatal."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("raw_roles", ROOT / "docs/_hooks/raw_roles.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)

    from types import SimpleNamespace

    Page = SimpleNamespace(file=SimpleNamespace(src_uri="api/emakit.md"))

    html = "<p>See :class:<code>~emakit.EMA</code> and <code>[`EMA`]</code> :meth:`update`</p>"
    with caplog.at_level("WARNING", logger="mkdocs"):
        assert hook.on_page_content(html, Page, None, None) == html
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "':class:`~emakit.EMA'" in messages[0] and "api/emakit.md" in messages[0]
    assert hook.on_page_content("<p><code>EMA</code> :: class</p>", Page, None, None)
    assert len(caplog.records) == 2
    assert "docs/_hooks/raw_roles.py" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_convert_roles_links_what_the_site_renders_and_spans_the_rest():
    pytest.importorskip("griffe")
    roles = _tool("convert_roles")
    root = roles._load()
    rendered = roles.rendered_paths(root)
    assert {"emakit.EMA", "emakit.checkpoint.save_ema_weights"} <= rendered
    assert "emakit._core.tracker.Tracker" not in rendered  # a private module: not on the site
    source = (
        '"""See :class:`~emakit.EMA`, :func:`save_ema_weights`, :meth:`emakit.EMA.update`,\n'
        ":class:`~emakit._core.tracker.Tracker`, :class:`~pathlib.Path`, :mod:`emakit.foreign`.\n"
        '"""\n'
        "x = 1  # see :func:`~emakit.checkpoint.save_ema_weights`\n"
    )
    out, links, spans = roles.convert_source(root, "emakit.checkpoint", source, rendered)
    assert out == (
        '"""See [`EMA`][emakit.EMA], [`save_ema_weights()`][emakit.checkpoint.save_ema_weights], '
        "[`emakit.EMA.update()`][emakit.EMA.update],\n"
        "`Tracker`, `Path`, [`emakit.foreign`][emakit.foreign].\n"
        '"""\n'
        "x = 1  # see `save_ema_weights()`\n"
    )
    assert (links, spans) == (4, 3)
    assert roles.convert_source(root, "emakit.checkpoint", out, rendered) == (out, 0, 0)
