"""The embedded text corpus ``pysource``: the Python standard library's own source, byte tokens.

No download: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` outside
``site-packages`` and ``dist-packages`` (directory symlinks are not followed), in the order of
their relative POSIX paths, read as raw bytes (the files are UTF-8 text; the bytes are the
tokens, so the vocabulary is 256 and any file round-trips). A file belongs to the validation
split when the first 8 bytes of the SHA-256 of its relative path, as a big-endian integer,
modulo 1000 are below :data:`VAL_PERMILLE`: the split depends on the path alone, so it is the
same on every call, every node and every machine with that Python release. The corpus differs between
Python releases: :class:`TokenCorpus` records the Python version, the byte counts and a SHA-256
over every (path, content) pair, which the built-in job writes into ``summary.json``.

The training split is cut into :class:`TokenData` windows of ``context + 1`` bytes starting every
``context`` bytes (sample ``i``: inputs ``train[i*context : i*context + context]``, targets the
same shifted by one), so a partition of the window indices (:mod:`~p2psync.training.partition`)
gives each node its own part of the text. Evaluation runs on :data:`EVAL_WINDOWS` windows spread
evenly over the validation split (a fixed subset, the same for every run with that corpus).
Pure numpy: the launcher imports it without torch.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from p2psync.errors import ConfigError

#: validation share of the files, in thousandths (about 5 %)
VAL_PERMILLE = 50
#: validation windows each evaluation reads (spread evenly over the validation split)
EVAL_WINDOWS = 64
VOCAB = 256
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def is_validation(relpath: str) -> bool:
    """Whether the file at ``relpath`` (POSIX, relative to the stdlib folder) is held out."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < VAL_PERMILLE


def source_files(root: str | Path | None = None) -> list[str]:
    """The corpus's files: relative POSIX paths of every ``.py`` under ``root`` (default: this
    interpreter's stdlib folder) outside ``site-packages``/``dist-packages``, sorted."""
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    if not base.is_dir():
        raise ConfigError(f"--data pysource: the standard library folder {base} is not a directory")
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel = Path(dirpath).relative_to(base)
        out.extend((rel / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(out)


def encode(text: str | bytes) -> np.ndarray:
    """Byte tokens (uint8) of ``text`` (a str is encoded as UTF-8)."""
    raw = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(raw, dtype=np.uint8).copy()


def decode(tokens: Any) -> str:
    """The text of byte tokens (any integer array or sequence in 0..255); bytes that are not
    UTF-8 become U+FFFD."""
    arr = np.asarray(tokens)
    if arr.size and (arr.min() < 0 or arr.max() >= VOCAB):
        raise ValueError("byte tokens must lie in 0..255")
    return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TokenCorpus:
    """A byte-token corpus split into training and validation streams (uint8 arrays)."""

    name: str
    train: np.ndarray
    val: np.ndarray
    #: what identifies the corpus (python version, files, bytes, sha256): recorded per run
    meta: dict[str, Any] = field(default_factory=dict)

    def unigram_bpb(self) -> float:
        """The entropy in bits of the training split's byte frequencies, measured on the
        validation split (cross-entropy; add-one smoothing): the loss of the best model that
        ignores context, the bar a language model must clear."""
        counts = np.bincount(self.train, minlength=VOCAB).astype(np.float64) + 1.0
        p = counts / counts.sum()
        freq = np.bincount(self.val, minlength=VOCAB).astype(np.float64)
        return float(-(freq * np.log2(p)).sum() / max(freq.sum(), 1.0))


_CACHE: dict[str, TokenCorpus] = {}


def pysource(root: str | Path | None = None) -> TokenCorpus:
    """The ``pysource`` corpus of this interpreter's standard library (``root``: another folder
    laid out the same way, for tests). Built once per process."""
    key = str(root)
    if key not in _CACHE:
        base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
        files = source_files(base)
        if not files:
            raise ConfigError(f"--data pysource: no .py files under {base}")
        h = hashlib.sha256()
        train: list[bytes] = []
        val: list[bytes] = []
        n_val_files = 0
        for rel in files:
            try:
                raw = (base / rel).read_bytes()
            except OSError as exc:
                raise ConfigError(f"--data pysource: cannot read {base / rel}: {exc}") from None
            h.update(rel.encode("utf-8") + b"\0" + len(raw).to_bytes(8, "big") + raw)
            if is_validation(rel):
                val.append(raw)
                n_val_files += 1
            else:
                train.append(raw)
        tr = np.frombuffer(b"".join(train), dtype=np.uint8)
        va = np.frombuffer(b"".join(val), dtype=np.uint8)
        meta = {"name": "pysource", "python": ".".join(map(str, sys.version_info[:3])),
                "files": len(files), "val_files": n_val_files, "bytes": int(tr.size + va.size),
                "train_bytes": int(tr.size), "val_bytes": int(va.size), "sha256": h.hexdigest()}
        _CACHE[key] = TokenCorpus("pysource", tr, va, meta)
    return _CACHE[key]


class TokenData:
    """A corpus as fixed-length windows for the built-in job (see the module docstring):
    ``n_train`` training samples, each ``context`` input bytes and the ``context`` bytes that
    follow them as targets."""

    lm = True

    def __init__(self, corpus: TokenCorpus, context: int, *, eval_windows: int = EVAL_WINDOWS) -> None:
        if context < 1:
            raise ConfigError("the context length must be >= 1")
        self.corpus = corpus
        self.name = corpus.name
        self.context = context
        self.n_train = (len(corpus.train) - 1) // context
        n_val = (len(corpus.val) - 1) // context
        if self.n_train < 1 or n_val < 1:
            raise ConfigError(f"--data {corpus.name}: too small for windows of {context} bytes")
        k = min(eval_windows, n_val)
        self.val_starts = (np.linspace(0, n_val - 1, k).round().astype(np.int64)) * context
        self._offsets = np.arange(context + 1, dtype=np.int64)

    @property
    def labels(self) -> np.ndarray:
        """What :func:`~p2psync.training.partition.partition` splits: one entry per window (no
        classes: only ``iid`` partitions apply)."""
        return np.zeros(self.n_train, dtype=np.int64)

    def windows(self, starts: np.ndarray, split: str = "train") -> tuple[np.ndarray, np.ndarray]:
        """(inputs, targets), int64 arrays of shape (len(starts), context), of the windows that
        begin at the byte offsets ``starts``."""
        src = self.corpus.train if split == "train" else self.corpus.val
        w = src[np.asarray(starts, dtype=np.int64)[:, None] + self._offsets].astype(np.int64)
        return w[:, :-1], w[:, 1:]

    def train_batch(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The training windows with indices ``idx``."""
        return self.windows(np.asarray(idx, dtype=np.int64) * self.context)

    def eval_batches(self, batch: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The fixed evaluation windows, ``batch`` at a time."""
        return [self.windows(self.val_starts[s: s + batch], "val") for s in range(0, len(self.val_starts), batch)]


def bits_per_byte(nats: float) -> float:
    """A mean loss in nats per byte token as bits per byte."""
    return nats / math.log(2)
