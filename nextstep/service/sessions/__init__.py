"""Next-item sessions: a session's clicks and the items recommended next (service.py), its routes (routes.py)."""
