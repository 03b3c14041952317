"""Multi-task fine-tuning of BERT + PALs with DeepSpeed.

    deepspeed train.py --ds_config configs/cpu_bf16.json [options]
    python train.py --ds_config configs/cpu_bf16.json [options]      # one process, DeepSpeed still the engine

`python train.py --help` lists every option; the code is in fastpals/train/.
"""

import sys

from fastpals.train import main

if __name__ == "__main__":
    sys.exit(main())
