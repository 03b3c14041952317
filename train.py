"""Multi-task fine-tuning of BERT + PALs with DeepSpeed.

    deepspeed train.py --ds_config configs/cpu_bf16.json [options]
    python train.py --ds_config configs/cpu_bf16.json [options]      # one process, DeepSpeed still the engine

`python train.py --help` lists every option; see fastpals/trainer.py.
"""

import sys

from fastpals.trainer import main

if __name__ == "__main__":
    sys.exit(main())
