"""``python -m emakit``: the same as the ``emakit`` command."""

from __future__ import annotations

from .cli import main

if __name__ == "__main__":
    main(prog_name="emakit")
