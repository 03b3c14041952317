"""fastpals inside other libraries' loops: :mod:`.transformers` (``MultiTaskTrainer``, a ``transformers.Trainer``
with surgery) and :mod:`.sentence_transformers` (one task as a ``SentenceTransformer``). Each submodule imports its
library; this package imports nothing."""
