"""fastpals: fused kernels for multi-task BERT fine-tuning with PALs and gradient surgery."""

__version__ = "0.1.0"
