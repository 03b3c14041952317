"""What users call: one module per ``fastpals`` command beside ``train`` (:mod:`fastpals.cli` dispatches).

- :mod:`.predict` (``fastpals predict``), :mod:`.export` (``fastpals export``);
- :mod:`.compare` (``fastpals compare``: recipes on one budget), :mod:`.claims` (``fastpals claims``);
- :mod:`.memory` (a training step's peak memory traced on fake tensors; what the step holds per rank is
  :mod:`fastpals.train.memory_states`), :mod:`.memory_cli` (``fastpals memory``: the command line, the ``docs/memory.md`` table) and
  :mod:`.memory_chart`.

This package imports nothing; each command loads what it needs.
"""
