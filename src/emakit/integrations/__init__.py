"""Integrations with training frameworks, each an optional extra imported on demand.

============================================  ===============================================
``emakit.integrations.lightning``             `EMACallback` for Lightning's ``Trainer``
                                              (``pip install lightning``)
``emakit.integrations.accelerate``            `prepare_ema()` for Hugging Face Accelerate
                                              (``pip install accelerate``)
``emakit.integrations.transformers``          `EMATrainerCallback` for the Hugging Face
                                              ``Trainer`` (``pip install transformers accelerate``)
============================================  ===============================================

This package imports nothing itself: ``import emakit.integrations`` never loads a
framework; each submodule imports its framework when it is imported.
"""

from __future__ import annotations

__all__: list[str] = []
