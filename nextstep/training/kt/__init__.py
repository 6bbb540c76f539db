"""Knowledge tracing: its readers (data.py), fit (loop.py), losses, runs (run.py, simakt_run.py), exporters
(export.py, simakt_export.py), memory banks, evaluation and studies."""
