"""Knowledge tracing: learners answering questions (service.py), its routes (routes.py), SimAKT's memory banks
(banks.py) and the scored step graphs of live quality (scored.py)."""
