"""One module per ``fastpals`` command beside ``train`` (:mod:`fastpals.cli` dispatches): predict, export,
compare, claims, memory (the traced peak, its table and charts)."""
