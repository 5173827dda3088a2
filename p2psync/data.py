"""Data sets for users' scripts that need no download.

``pysource()``: the Python standard library's own source as byte tokens (vocabulary 256), split
into training and validation by a stable hash of each file's path; ``encode``/``decode`` map
text to tokens and back. See :mod:`p2psync.training.corpus` for the exact contract. Pure numpy:
importing this module does not import torch.
"""

from __future__ import annotations

from p2psync.training.corpus import TokenCorpus, decode, encode, pysource

__all__ = ["TokenCorpus", "decode", "encode", "pysource"]
