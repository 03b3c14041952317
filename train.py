"""Multi-task fine-tuning of BERT + PALs with DeepSpeed.

    deepspeed train.py --ds_config configs/cpu_bf16.json [options]
    python train.py --ds_config configs/cpu_bf16.json [options]      # one process, DeepSpeed still the engine

`python train.py --help` lists every option; the code is in fastpals/train/.
"""

import signal
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

ctrl_c_seen: list[int] = []


def _on_ctrl_c(signum: int, frame: FrameType | None) -> None:
    ctrl_c_seen.append(signum)
    raise KeyboardInterrupt


def _on_unraisable(info: Any, default: Callable[[Any], object] = sys.unraisablehook) -> None:
    if isinstance(
        info.exc_value, KeyboardInterrupt
    ):  # a Ctrl-C Python swallowed (in an import lock's callback)
        ctrl_c_seen.append(signal.SIGINT)
    else:
        default(info)


signal.signal(signal.SIGINT, _on_ctrl_c)
sys.unraisablehook = _on_unraisable
try:
    from fastpals.train import main
except KeyboardInterrupt:
    ctrl_c_seen.append(signal.SIGINT)
if ctrl_c_seen:  # Ctrl-C while the libraries load: one line, code 130 (as later in the set-up)
    print("train.py: interrupted by Ctrl-C during the set-up: nothing was trained", file=sys.stderr)
    sys.exit(130)
sys.unraisablehook = sys.__unraisablehook__
signal.signal(signal.SIGINT, signal.default_int_handler)

if __name__ == "__main__":
    sys.exit(main())
