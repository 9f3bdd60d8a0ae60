"""A griffe extension for the API reference: emakit's docstrings head their doctests
``Example:`` (Google style allows it), which griffe's Google parser does not know as a
section; it would render the doctest as Markdown (``[16]`` becoming a link). This renames
the heading to ``Examples:``, which griffe renders as code."""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    """Rename ``Example:`` section headings to ``Examples:`` before parsing."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
