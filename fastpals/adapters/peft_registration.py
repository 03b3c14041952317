"""Registering fastpals' PAL adapters as a PEFT method (:mod:`fastpals.adapters.peft_method`) without importing PEFT
before the user does: PEFT is optional, and importing it (with transformers) takes seconds.

``import fastpals`` calls :func:`register_when_peft_is_imported`: if PEFT is already imported the method is
registered at once; if it is installed but not imported, a finder on ``sys.meta_path`` registers it right after
the first ``import peft`` runs (the finder only wraps PEFT's own loader for that one import, then removes
itself); if it is not installed nothing happens. :func:`register_with_peft` registers explicitly.
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["register_when_peft_is_imported", "register_with_peft"]


def register_with_peft() -> None:
    """Register fastpals' PAL adapters (``peft_type`` ``"FASTPALS"``) with PEFT, so that
    ``peft.PeftModel.from_pretrained(model, folder)``, ``peft.PeftConfig.from_pretrained(folder)`` and
    ``peft.get_peft_model(model, fastpals.adapters.peft_method.FastPalsConfig(...))`` work on them.

    Idempotent. ``import fastpals`` does it as soon as PEFT is imported; call it yourself only to get an error
    instead of a warning when it cannot be done. Raises ``ImportError`` when PEFT is not installed or too old.
    """
    from fastpals.adapters.peft_method import register

    register()


def _register_or_warn() -> None:
    method = sys.modules.get("fastpals.adapters.peft_method")
    if method is not None and not hasattr(method, "register"):
        return  # PEFT imported by fastpals.adapters.peft_method itself, which registers once its import ends
    try:
        register_with_peft()
    except Exception as err:  # never break the user's `import peft`
        warnings.warn(
            f"fastpals could not register its PAL adapters with PEFT ({type(err).__name__}: {err}); "
            "peft.PeftModel.from_pretrained will not open fastpals adapters (fastpals.load_pals does)",
            RuntimeWarning,
            stacklevel=2,
        )


class _RegisterAfterPeftImport:
    """A ``sys.meta_path`` finder for the module ``peft`` only: it finds PEFT with the other finders and wraps
    that spec's loader so that fastpals registers its method once PEFT's ``__init__`` has run."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        """The spec the other finders give for ``peft``, with registration after execution; None otherwise."""
        if fullname != "peft":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec

        def exec_module(module: ModuleType) -> None:
            run(module)
            self.remove()
            _register_or_warn()

        # on this spec's loader object only (a new one per find_spec): a probe such as importlib.util.find_spec
        # ("peft") that does not import leaves the finder in place for the real import
        loader.exec_module = exec_module
        return spec

    def remove(self) -> None:
        """Take this finder off ``sys.meta_path``."""
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def register_when_peft_is_imported() -> None:
    """Register fastpals with PEFT now if PEFT is imported, else right after it is imported (if installed)."""
    if "peft" in sys.modules:
        if sys.modules["peft"] is not None:  # None: imports of peft are blocked
            _register_or_warn()
        return
    if any(isinstance(f, _RegisterAfterPeftImport) for f in sys.meta_path):
        return
    try:
        installed = importlib.util.find_spec("peft") is not None
    except (ImportError, ValueError):
        installed = False
    if installed:
        sys.meta_path.insert(0, _RegisterAfterPeftImport())
