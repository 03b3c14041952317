"""fastpals inside other libraries' training and serving loops.

- :mod:`fastpals.integrations.transformers`: :class:`~fastpals.integrations.transformers.MultiTaskTrainer`, a
  ``transformers.Trainer`` that trains a :class:`fastpals.MultiTaskBert` on mixed-task batches with any fastpals
  aggregator (PCGrad, GEM, UPGrad, ...) from one backward per micro-batch.
- :mod:`fastpals.integrations.sentence_transformers`: one task of a trained model as a
  ``sentence_transformers.SentenceTransformer`` folder (``fastpals export``).

The submodules import their library on import; this package imports nothing.
"""
