"""Wire types and subject names of Sparkwire. Nothing here does work.

One module per receiving service (`scheduler`, `detokenizer`, `tokenizer`), plus `arrays` (the
ndarray wire form), `control` (heartbeats, shared by every service) and `subjects`.
"""
