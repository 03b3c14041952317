"""PALs put into an encoder someone already has (:mod:`.inject`, the per-architecture :mod:`.targets`), the
one adapter :mod:`.format`, and the PEFT method (:mod:`.peft_method`)."""

from fastpals.adapters.format import read_adapter, write_adapter
from fastpals.adapters.inject import inject_pals, load_pals, remove_pals, save_pals, set_task
from fastpals.adapters.targets import TARGETS

__all__ = [
    "TARGETS",
    "inject_pals",
    "load_pals",
    "read_adapter",
    "register_with_peft",
    "remove_pals",
    "save_pals",
    "set_task",
    "write_adapter",
]


def register_with_peft() -> None:
    """Register fastpals' PAL adapters with PEFT as ``peft_type`` ``"FASTPALS"`` (``get_peft_model``,
    ``PeftModel.from_pretrained``, ``PeftConfig.from_pretrained``). Idempotent; imports PEFT, so
    ``ImportError`` when PEFT is missing or too old."""
    from fastpals.adapters.peft_method import register  # optional dependency, seconds to import

    register()
