"""mkdocs hook: a ```py block is a fragment, and the site says so.

The docs tag a code block ```python when it runs on its own (tests/test_docs_blocks.py runs
every one in a fresh process) and ```py when it is a fragment that uses the reader's own
model, optimizer, data or loop. This hook gives each ```py block a title saying that, so a
reader knows which blocks to copy whole (pymdownx.highlight renders the title).
"""

from __future__ import annotations

import re

TITLE = "Fragment: uses your own model, optimizer, data or loop"
FRAGMENT = re.compile(r"^(?P<indent> *)```py[ \t]*$", re.M)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return FRAGMENT.sub(lambda m: f'{m.group("indent")}```py title="{TITLE}"', markdown)
