"""Byte-level text corpora for ``fp8jax train``, and deterministic batches from them.

The default corpus is the Python standard library's own source code on this
machine (``sysconfig.get_paths()["stdlib"]``): tens of megabytes of real text
that every Python install has, so nothing is downloaded. ``--data PATH`` takes
any text file or folder instead. Text is read as bytes, so the vocabulary is
the 256 byte values and there is no tokenizer.

The split is deterministic: a file goes to validation when the CRC-32 of its
path relative to the corpus root falls in one bucket of
:data:`VALIDATION_BUCKETS`. When that leaves one side empty (a single file, a
handful of files) the last 1/:data:`VALIDATION_BUCKETS` of the bytes is the
validation set instead.

Batches are a pure function of ``(seed, step)``, so a resumed run sees exactly
the batches an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import sysconfig
import zlib

import numpy as np

VOCAB_SIZE = 256
VALIDATION_BUCKETS = 20  # 1 in 20 files (or the last 5% of the bytes) is validation
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_BINARY_PROBE = 8192  # a NUL byte in a file's first 8 KiB marks it as binary


class DataError(ValueError):
    """The data path is missing, empty, or too small for the run."""


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A byte corpus split into train and validation streams.

    Attributes:
      train: uint8 bytes of the training files, concatenated in path order.
      validation: uint8 bytes of the validation files.
      source: where the text came from (a path).
      files: number of files read.
      fingerprint: SHA-256 of both streams; a resumed run must see the same.
    """

    train: np.ndarray
    validation: np.ndarray
    source: str
    files: int
    fingerprint: str

    def describe(self) -> str:
        """One line for the run's log."""
        return (
            f"{self.source}: {self.files} files, {self.train.size / 1e6:.2f} MB train, "
            f"{self.validation.size / 1e6:.2f} MB validation"
        )


def default_corpus_path() -> pathlib.Path:
    """The standard library's source directory of the running Python."""
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _stdlib_files(root: pathlib.Path) -> list[pathlib.Path]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Installed packages live under the stdlib directory; they are not the stdlib.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("."))
        files.extend(pathlib.Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return files


def _text_files(root: pathlib.Path, hidden: list[str]) -> list[pathlib.Path]:
    """The files under ``root`` not hidden; the hidden entries' relative paths go to ``hidden``."""
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = pathlib.Path(dirpath)
        hidden.extend((here / n).relative_to(root).as_posix() for n in dirnames + filenames
                      if n.startswith("."))  # fmt: skip
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        files.extend(here / f for f in filenames if not f.startswith("."))
    return files


def _skipped(hidden: list[str], binary: list[str], empty: list[str]) -> str:
    """What a folder's reading skipped and why, for the error that says it found no text."""
    parts = []
    nul = f"a NUL byte in the first {_BINARY_PROBE // 1024} KiB, "
    for names, one, many, why in (
        (hidden, "hidden entry", "hidden entries", "names starting with '.', "),
        (binary, "binary file", "binary files", nul),
        (empty, "empty file", "empty files", ""),
    ):
        if names:
            what = one if len(names) == 1 else many
            parts.append(f"{len(names)} {what} ({why}e.g. {sorted(names)[0]!r})")
    if not parts:
        return ""
    listed = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"; skipped {listed}"


def _is_validation(relative: str) -> bool:
    return zlib.crc32(relative.encode()) % VALIDATION_BUCKETS == 0


def load_corpus(path: str | os.PathLike | None = None) -> Corpus:
    """Reads a corpus: the stdlib's ``.py`` files, or the text files at ``path``.

    Args:
      path: a text file or a folder (searched recursively; hidden entries and
        files with NUL bytes are skipped). None reads the standard library.

    Returns:
      The :class:`Corpus`.

    Raises:
      DataError: if ``path`` does not exist or holds no text.

    Example:
      >>> import tempfile, pathlib
      >>> from fp8jax.data import load_corpus
      >>> f = pathlib.Path(tempfile.mkdtemp(), "a.txt")
      >>> _ = f.write_text("hello world " * 100)
      >>> c = load_corpus(f)
      >>> c.train.size + c.validation.size, c.validation.size
      (1200, 60)
    """
    hidden: list[str] = []
    if path is None:
        root = default_corpus_path()
        files = _stdlib_files(root)
    else:
        root = pathlib.Path(path).expanduser()
        if not root.exists():
            raise DataError(
                f"--data {str(path)!r} does not exist; pass a text file or a folder of text "
                "files, or leave --data out to train on the Python standard library's source."
            )
        # Anything but a folder is read as one file: a pipe (`--data <(zcat a.gz)`) too.
        files = _text_files(root, hidden) if root.is_dir() else [root]
    texts: list[tuple[str, bytes]] = []
    binary: list[str] = []
    empty: list[str] = []
    for file in sorted(files):
        data = file.read_bytes()
        relative = file.name if file == root else file.relative_to(root).as_posix()
        if not data:
            empty.append(relative)
        elif b"\0" in data[:_BINARY_PROBE]:
            binary.append(relative)
        else:
            texts.append((relative, data))
    if not texts:
        kind = "folder has no non-empty text file" if root.is_dir() else "file is empty or binary"
        skipped = _skipped(hidden, binary, empty) if root.is_dir() else ""
        raise DataError(
            f"--data {str(root)!r}: the {kind}{skipped}; fp8jax train needs text to read as bytes."
        )
    train = b"".join(d for r, d in texts if not _is_validation(r))
    validation = b"".join(d for r, d in texts if _is_validation(r))
    if not train or not validation:
        everything = b"".join(d for _, d in texts)
        cut = len(everything) - len(everything) // VALIDATION_BUCKETS
        train, validation = everything[:cut], everything[cut:]
    digest = hashlib.sha256(train)
    digest.update(b"\0validation\0")
    digest.update(validation)
    return Corpus(
        train=np.frombuffer(train, np.uint8),
        validation=np.frombuffer(validation, np.uint8),
        source=str(root),
        files=len(texts),
        fingerprint=digest.hexdigest(),
    )


def check_size(corpus: Corpus, seq_len: int) -> None:
    """Raises DataError unless both streams hold at least one ``seq_len + 1`` window."""
    need = seq_len + 1
    for name, stream in (("training", corpus.train), ("validation", corpus.validation)):
        if stream.size < need:
            raise DataError(
                f"{corpus.source}: the {name} split has {stream.size} bytes, fewer than the "
                f"{need} one sequence needs (seq_len={seq_len} + 1); pass more text with --data "
                "or a shorter --seq-len."
            )


def _windows(stream: np.ndarray, starts: np.ndarray, seq_len: int) -> np.ndarray:
    return stream[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


def train_batch(stream: np.ndarray, step: int, *, batch_size: int, seq_len: int, seed: int):
    """The training batch of ``step``: ``batch_size`` random windows of ``seq_len + 1`` bytes.

    Returns int32 ``(batch_size, seq_len + 1)``; inputs are ``[:, :-1]``,
    targets ``[:, 1:]``. The same ``(seed, step)`` always gives the same batch.

    Example:
      >>> import numpy as np
      >>> from fp8jax.data import train_batch
      >>> stream = np.arange(100, dtype=np.uint8)
      >>> b = train_batch(stream, 7, batch_size=2, seq_len=4, seed=0)
      >>> b.shape, bool((np.diff(b, axis=1) == 1).all())
      ((2, 5), True)
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, stream.size - seq_len, size=batch_size)
    return _windows(stream, starts, seq_len)


def validation_batches(stream: np.ndarray, *, batches: int, batch_size: int, seq_len: int):
    """``batches`` fixed batches of windows spread evenly over the validation stream."""
    n = batches * batch_size
    starts = np.linspace(0, stream.size - seq_len - 1, n).astype(np.int64)
    return _windows(stream, starts, seq_len).reshape(batches, batch_size, seq_len + 1)
