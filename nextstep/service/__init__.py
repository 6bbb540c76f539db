"""Online serving: the protocol-neutral core (state store, ...) under thin HTTP routes."""
