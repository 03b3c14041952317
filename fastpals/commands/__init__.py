"""What users call: one module per ``fastpals`` command beside ``train`` (:mod:`fastpals.cli` dispatches).

- :mod:`.predict` (``fastpals predict``), :mod:`.export` (``fastpals export``);
- :mod:`.compare` (``fastpals compare``: recipes on one budget), :mod:`.claims` (``fastpals claims``);
- :mod:`.memory` (``fastpals memory``: a training step's peak memory traced on fake tensors), with
  :mod:`.memory_states` and :mod:`.memory_chart`.

This package imports nothing; each command loads what it needs.
"""
