"""Multi-task fine-tuning of BERT + PALs with DeepSpeed.

    deepspeed train.py --ds_config configs/cpu_bf16.json [options]
    python train.py --ds_config configs/cpu_bf16.json [options]      # one process, DeepSpeed still the engine

`python train.py --help` lists every option; the code is in fastpals/train/.
"""

import sys

try:
    from fastpals.train import main
except KeyboardInterrupt:  # Ctrl-C while the libraries load: one line, code 130 (as later in the set-up)
    print("train.py: interrupted by Ctrl-C during the set-up: nothing was trained", file=sys.stderr)
    sys.exit(130)

if __name__ == "__main__":
    sys.exit(main())
