"""Flashcards (spaced repetition): review-log readers (reviews.py), the srs-benchmark protocol and baselines
(eval.py), the time-aware transformer's fit, run and exporter, and the many-collection study (collections.py)."""
