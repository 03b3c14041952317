"""The PEFT method ``FASTPALS`` under the import path the README showed first; it lives in
:mod:`fastpals.adapters.peft_method` (imports PEFT)."""

from fastpals.adapters.peft_method import *  # noqa: F403
from fastpals.adapters.peft_method import __all__  # noqa: F401
