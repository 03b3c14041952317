"""One module per ``fastpals`` command beside ``train`` (:mod:`fastpals.cli` dispatches): predict, export,
compare, claims (with claims_jobs), memory (the traced peak; memory_cli is the command, memory_chart its chart).
This package imports nothing; each command loads what it needs."""
