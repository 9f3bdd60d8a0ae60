"""mkdocs hook: a Sphinx role left in a docstring or page fails the strict build.

mkdocstrings renders Markdown, so ``:class:`EMA``` shows on the site as literal text.
Each page's HTML is searched for a role as the Markdown renderer leaves it (the role name,
then the code span); every hit is logged as a warning, which ``mkdocs build --strict``
turns into a failed build. ``python tools/convert_roles.py`` rewrites them into autorefs
cross-references (``[`EMA`][emakit.EMA]``).
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger("mkdocs.hooks.raw_roles")
RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|data|exc|obj):(?:<code>|`)([^<`]*)")


def on_page_content(html: str, page, config, files) -> str:
    for match in RAW_ROLE.finditer(html):
        log.warning(
            "%s: raw Sphinx role %r shows as literal text; write [`Name`][emakit.path] "
            "(python tools/convert_roles.py converts them)",
            page.file.src_uri,
            match.group(0).replace("<code>", "`"),
        )
    return html
