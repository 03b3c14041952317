"""Registering fastpals' PAL adapters as the PEFT method ``FASTPALS`` (:mod:`fastpals.adapters.peft_method`).

PEFT is optional and importing it (with transformers) takes seconds, so ``import fastpals`` never imports it:
it registers the method when PEFT is already imported. Otherwise call :func:`register_with_peft`, or import
:mod:`fastpals.adapters.peft_method`, before PEFT loads a fastpals adapter.
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["register_if_peft_is_imported", "register_with_peft"]


def register_with_peft() -> None:
    """Register fastpals' PAL adapters (``peft_type`` ``"FASTPALS"``) with PEFT, so that
    ``peft.PeftModel.from_pretrained(model, folder)``, ``peft.PeftConfig.from_pretrained(folder)`` and
    ``peft.get_peft_model(model, fastpals.adapters.peft_method.FastPalsConfig(...))`` work on them.

    Idempotent; imports PEFT. Raises ``ImportError`` when PEFT is not installed or too old.
    """
    from fastpals.adapters.peft_method import register  # imports PEFT: optional, seconds

    register()


def register_if_peft_is_imported() -> None:
    """Register with PEFT if PEFT is already imported (``import fastpals`` calls this); a failure is a warning."""
    if sys.modules.get("peft") is None:  # not imported, or imports of peft blocked
        return
    try:
        register_with_peft()
    except Exception as err:  # never break the user's `import fastpals`
        warnings.warn(
            f"fastpals could not register its PAL adapters with PEFT ({type(err).__name__}: {err}); "
            "peft.PeftModel.from_pretrained will not open fastpals adapters (fastpals.load_pals does)",
            RuntimeWarning,
            stacklevel=2,
        )
