"""fastpals benchmarks: ``pytest bench/ --benchmark-only`` runs the suites, ``python -m bench.report`` rebuilds
``bench/results/REPORT.md`` and the charts from ``bench/results/*.json``, ``python -m bench.memory_report`` (CUDA)
searches the largest batch that trains under each GPU's memory."""
