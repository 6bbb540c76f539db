"""Flashcards: a user's reviews, their rating, recall and answer time, and schedules (service.py), its routes
(routes.py), the FSRS-6 refits run off the request path (refit.py) and the simulation of a collection
(simulate.py)."""
