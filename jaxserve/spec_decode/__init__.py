"""Speculative decoding proposers: each guesses the next tokens of a running sequence on the
host; the scheduler runs them as one verify row and the engine keeps the accepted prefix
(jaxserve/engine.py, `_accept`); the throttle (throttle.py) decides which steps speculate."""
