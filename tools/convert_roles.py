"""Turn the Sphinx roles left in emakit's docstrings into Markdown the site renders.

``:class:`~emakit.ema.EMA``` and its kin (``:func:``, ``:meth:``, ``:attr:``, ``:mod:``,
``:data:``, ``:exc:``, ``:obj:``) show as literal text in the mkdocstrings API reference.
This rewrites each into a mkdocs-autorefs cross-reference, ``[`EMA`][emakit.EMA]``, when
its target is an object the site renders, and into a plain code span, ``` `EMA` ```, when
it is not (a private module such as ``emakit._core.tracker``, an undocumented name, a torch
or standard-library object). Sphinx's display rules are kept: ``~a.b.C`` shows ``C``,
``a.b.C`` shows ``a.b.C``, and functions and methods get ``()``.

A target is resolved the way Sphinx does for the docstring it sits in: relative to the
enclosing class and function, then the module (names it defines or imports), then the
``emakit`` package; a leading ``.`` is relative to the module's package. What the site
renders is read from the ``::: identifier`` lines of docs/ and the mkdocstrings options in
mkdocs.yml (public names with a docstring, members of rendered modules and classes), with
griffe, the library mkdocstrings itself uses, so nothing is imported.

Roles in comments become code spans (a comment is read in the source, not on the site).
Running it twice changes nothing the second time. Usage, from the repository root::

    python tools/convert_roles.py            # rewrite src/ in place, print a summary
    python tools/convert_roles.py --check    # exit 1 and list the roles left, change nothing
"""

from __future__ import annotations

import argparse
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "emakit"
ROLE = re.compile(r":(?:py:)?(class|func|meth|attr|mod|data|exc|obj):`([^`]+)`")
CALLABLE_ROLES = {"func", "meth"}


def find_roles(text: str) -> list[tuple[int, str]]:
    """Every raw role in ``text``: (line number, the role as written)."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in ROLE.finditer(text)]


def _load():
    import griffe

    return griffe.load(PACKAGE, search_paths=[str(SRC)], resolve_aliases=False)


def _target(obj):
    """The object an alias points at, or None when it leaves the package."""
    seen = 0
    while obj is not None and getattr(obj, "is_alias", False):
        seen += 1
        try:
            obj = obj.target
        except Exception:  # an import of torch, pathlib...: not ours
            return None
        if seen > 20:
            return None
    return obj


def _lookup(root, path: str):
    """The griffe object at a dotted path (aliases followed), or None."""
    parts = path.split(".")
    if parts[0] != PACKAGE:
        return None
    obj = root
    for part in parts[1:]:
        obj = _target(obj)
        if obj is None or part not in obj.members:
            return None
        obj = obj.members[part]
    return _target(obj) or None


def _has_docs(obj) -> bool:
    if obj.docstring is not None and obj.docstring.value.strip():
        return True
    return any(
        not name.startswith("_") and not getattr(m, "is_alias", False) and _has_docs(m)
        for name, m in obj.members.items()
    )


def rendered_paths(root, docs: Path = ROOT / "docs") -> set[str]:
    """Every identifier the site has an anchor for, with each object's canonical path
    (autorefs resolves both)."""
    found: set[str] = set()

    def visit(obj, path: str, members: list[str] | None = None) -> None:
        obj = _target(obj)
        if obj is None or not _has_docs(obj):
            return
        found.add(path)
        found.add(obj.path)
        if not (obj.is_module or obj.is_class):
            return
        exports = getattr(obj, "exports", None) if obj.is_module else None
        if members is not None:
            exports = members  # the page's `options: members:` list
        for name, member in obj.members.items():
            if name.startswith("_"):
                continue
            if exports is not None and name not in exports:
                continue  # a module with __all__ renders exactly those names
            if exports is None and getattr(member, "is_alias", False):
                continue  # without __all__, imported names are not rendered
            if getattr(member, "is_module", False):
                continue  # submodules get their own page or none
            visit(member, f"{path}.{name}")

    for page in sorted(docs.rglob("*.md")):
        for ident, members in _directives(page.read_text(encoding="utf-8")):
            obj = _lookup(root, ident)
            if obj is not None:
                visit(obj, ident, members)
    return found


def _directives(text: str) -> list[tuple[str, list[str] | None]]:
    """The ``::: identifier`` lines of a page, each with its ``options: members:`` list
    (None when the page does not restrict the members)."""
    found: list[tuple[str, list[str] | None]] = []
    in_members = False
    for line in text.splitlines():
        if line.startswith("::: "):
            found.append((line[4:].strip(), None))
            in_members = False
        elif found and re.match(r"\s+members:\s*(false|\[\])\s*$", line):
            found[-1] = (found[-1][0], [])  # the object alone, none of its members
            in_members = False
        elif found and re.match(r"\s+members:\s*$", line):
            found[-1] = (found[-1][0], [])
            in_members = True
        elif in_members and (item := re.match(r"\s+- (\S+)\s*$", line)):
            found[-1][1].append(item.group(1))  # type: ignore[union-attr]
        elif line.strip() and not line.startswith(" "):
            in_members = False
    return found


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _scopes(root, module: str, line: int) -> list[str]:
    """Dotted paths of the objects enclosing ``line``, innermost first, ending at the
    module."""
    mod = _lookup(root, module)
    chain = [module]
    obj = mod
    while obj is not None:
        inner = None
        for name, member in obj.members.items():
            if getattr(member, "is_alias", False) or not (member.is_class or member.is_function):
                continue
            start, end = member.lineno or 0, member.endlineno or 0
            if start <= line <= end:
                inner = member
                chain.append(f"{chain[-1]}.{name}")
                break
        obj = inner
    return chain[::-1]


def resolve(root, module: str, line: int, target: str) -> str | None:
    """The full dotted path ``target`` names from ``line`` of ``module``, or None."""
    if target.startswith("."):
        package = module if _lookup(root, module).is_package else module.rsplit(".", 1)[0]
        dots = len(target) - len(target.lstrip("."))
        base = package.rsplit(".", dots - 1)[0] if dots > 1 else package
        candidates = [f"{base}.{target.lstrip('.')}"]
    else:
        candidates = [f"{scope}.{target}" for scope in _scopes(root, module, line)]
        candidates += [target, f"{PACKAGE}.{target}"]
    for candidate in candidates:
        obj = _lookup(root, candidate)
        if obj is not None:
            return candidate
    return None


def _link_path(root, path: str, rendered: set[str]) -> str | None:
    """The identifier to link ``path`` to, or None when the site does not render it."""
    if path in rendered:
        return path
    obj = _lookup(root, path)
    if obj is not None and obj.path in rendered:
        return obj.path
    # a member reached through a rendered alias, e.g. emakit.EMA.update for emakit.ema.EMA.update
    owner, _, name = path.rpartition(".")
    owner_obj = _lookup(root, owner) if owner else None
    if owner_obj is not None:
        for ident in rendered:
            if ident.endswith(f".{name}") and _lookup(root, ident.rsplit(".", 1)[0]) is owner_obj:
                return ident
    return None


def replacement(role: str, target: str, link: str | None) -> str:
    """The Markdown for one role: a cross-reference when ``link`` is set, else a code span."""
    shown = target.lstrip("~")
    if target.startswith("~"):
        shown = shown.rsplit(".", 1)[-1]
    shown = shown.lstrip(".")
    if role in CALLABLE_ROLES and not shown.endswith(")"):
        shown += "()"
    return f"[`{shown}`][{link}]" if link else f"`{shown}`"


def convert_source(root, module: str, text: str, rendered: set[str]) -> tuple[str, int, int]:
    """``text`` with every role rewritten: (new text, links made, code spans made)."""
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for ln in lines:
        offsets.append(offsets[-1] + len(ln))
    edits: list[tuple[int, int, str]] = []
    counts = [0, 0]
    for tok in tokens:
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            continue
        start = offsets[tok.start[0] - 1] + tok.start[1]
        for m in ROLE.finditer(tok.string):
            role, target = m.group(1), m.group(2).strip()
            line = tok.start[0] + tok.string.count("\n", 0, m.start())
            link = None
            if tok.type == tokenize.STRING:
                full = resolve(root, module, line, target.lstrip("~").rstrip("()"))
                link = _link_path(root, full, rendered) if full else None
            counts[0 if link else 1] += 1
            edits.append((start + m.start(), start + m.end(), replacement(role, target, link)))
    for begin, end, new in sorted(edits, reverse=True):
        text = text[:begin] + new + text[end:]
    return text, counts[0], counts[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list raw roles, change nothing")
    parser.add_argument("paths", nargs="*", type=Path, help="files (default: every .py in src/)")
    args = parser.parse_args(argv)
    files = [p.resolve() for p in args.paths] or sorted((SRC / PACKAGE).rglob("*.py"))
    if args.check:
        left = [
            f"{f.relative_to(ROOT)}:{n}: {r}"
            for f in files
            for n, r in find_roles(f.read_text(encoding="utf-8"))
        ]
        print("\n".join(left) or "no raw Sphinx roles")
        return 1 if left else 0
    root = _load()
    rendered = rendered_paths(root)
    links = spans = changed = 0
    for f in files:
        text = f.read_text(encoding="utf-8")
        if not ROLE.search(text):
            continue
        new, n_links, n_spans = convert_source(root, _module_name(f), text, rendered)
        links, spans, changed = links + n_links, spans + n_spans, changed + 1
        f.write_text(new, encoding="utf-8")
    print(f"{changed} files: {links} cross-references, {spans} code spans")
    return 0


if __name__ == "__main__":
    sys.exit(main())
