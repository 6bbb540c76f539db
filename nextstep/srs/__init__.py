"""What training and the service share about flashcards, numpy (and fsrs-rs) only: which past reviews a query
sees (review_window.py), a card's FSRS-6 memory from them (card_memory.py), and FSRS-6 fitted on a user's stored
reviews (stored_fit.py: the service's refit, run in a process of its own)."""
