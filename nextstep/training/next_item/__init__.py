"""Next-item recommendation: session readers (sessions.py), the official ranking protocol, the learned families'
fits (gru4rec_loop.py, mrn_loop.py), the run shared by every next-item family (run.py) and its exporter."""
