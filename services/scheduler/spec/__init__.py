"""Speculative decoding: the proposer seam (`base.py`), the accept rule (`accept.py`), DSpark."""
