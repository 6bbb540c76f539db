"""Knowledge tracing: learners answering questions (service.py), its routes (routes.py) and SimAKT's memory banks
(banks.py)."""
