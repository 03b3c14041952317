"""PALs put into an encoder someone already has (:mod:`.inject`, with the per-architecture :mod:`.targets` and
the forward :mod:`.hooks`), the one adapter :mod:`.format`, and the PEFT method (:mod:`.peft_method`, registered
by :mod:`.peft_registration` without importing PEFT first)."""

from fastpals.adapters.format import read_adapter, write_adapter
from fastpals.adapters.inject import inject_pals, load_pals, remove_pals, save_pals, set_task
from fastpals.adapters.peft_registration import register_with_peft
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
