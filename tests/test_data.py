"""fp8jax.data: the stdlib corpus, --data files and folders, the split, deterministic batches."""

import doctest
import zlib

import numpy as np
import pytest

from fp8jax import data


def test_default_corpus_is_the_stdlib_source_without_site_packages():
    corpus = data.load_corpus()
    assert corpus.source == str(data.default_corpus_path())
    assert corpus.files > 100
    assert corpus.train.dtype == np.uint8 and corpus.train.size > 1_000_000
    # About 1 file in VALIDATION_BUCKETS; by bytes it varies with file sizes.
    assert 0.01 < corpus.validation.size / corpus.train.size < 0.15
    assert b"def " in corpus.train[:200_000].tobytes()
    assert data.load_corpus().fingerprint == corpus.fingerprint  # deterministic


def test_folder_split_is_by_path_hash_and_skips_binary_and_hidden(tmp_path):
    names = [f"pkg/m{i}.txt" for i in range(60)]
    for name in names:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(f"# {name}\n" * 20)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "secret.txt").write_text("never read")
    (tmp_path / "empty.txt").write_text("")
    corpus = data.load_corpus(tmp_path)
    assert corpus.files == 60
    val = [n for n in names if zlib.crc32(n.encode()) % data.VALIDATION_BUCKETS == 0]
    assert val, "pick names so that some land in validation"
    # Exactly those files are validation, and every other one is train (in path order):
    # a split that put more files in validation would still hold each of these.
    train = sorted(set(names) - set(val))
    assert corpus.validation.tobytes() == b"".join((tmp_path / n).read_bytes() for n in sorted(val))
    assert corpus.train.tobytes() == b"".join((tmp_path / n).read_bytes() for n in train)


def test_one_file_splits_off_its_tail(tmp_path):
    f = tmp_path / "book.txt"
    f.write_bytes(bytes(range(32, 127)) * 100)
    corpus = data.load_corpus(f)
    everything = f.read_bytes()
    cut = len(everything) - len(everything) // data.VALIDATION_BUCKETS
    assert corpus.train.tobytes() == everything[:cut]
    assert corpus.validation.tobytes() == everything[cut:]


@pytest.mark.parametrize("kind", ["missing", "empty file", "empty folder", "binary file"])
def test_unusable_data_paths_are_refused_with_a_clear_error(tmp_path, kind):
    path = tmp_path / "data"
    if kind == "empty file":
        path.write_text("")
    elif kind == "empty folder":
        path.mkdir()
        (path / "empty.txt").write_text("")
    elif kind == "binary file":
        path.write_bytes(b"\0" * 100)
    with pytest.raises(data.DataError, match="--data") as e:
        data.load_corpus(path)
    expected = {"missing": "does not exist", "empty file": "empty", "binary file": "binary"}
    assert expected.get(kind, "no non-empty text file") in str(e.value)


def test_too_small_corpus_names_the_sizes(tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("x" * 200)
    with pytest.raises(data.DataError, match="validation split has 10 bytes.*seq_len=64"):
        data.check_size(data.load_corpus(f), 64)


def test_train_batches_are_a_function_of_seed_and_step():
    stream = np.frombuffer(bytes(range(256)) * 40, np.uint8)
    a = data.train_batch(stream, 3, batch_size=4, seq_len=16, seed=0)
    assert a.shape == (4, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, data.train_batch(stream, 3, batch_size=4, seq_len=16, seed=0))
    assert not np.array_equal(a, data.train_batch(stream, 4, batch_size=4, seq_len=16, seed=0))
    assert not np.array_equal(a, data.train_batch(stream, 3, batch_size=4, seq_len=16, seed=1))
    # Windows are contiguous bytes of the stream.
    assert ((np.diff(a, axis=1) % 256) == 1).all()


def test_validation_batches_cover_the_stream_evenly():
    # Under 256 bytes, each byte is its own offset, so a window's first byte is its start.
    stream = np.arange(250, dtype=np.uint8)
    v = data.validation_batches(stream, batches=2, batch_size=3, seq_len=9)
    assert v.shape == (2, 3, 10)
    starts = v[:, :, 0].reshape(-1).astype(np.int64)
    # Six windows from the first (0) to the last possible start (250 - 10), equally spaced.
    np.testing.assert_array_equal(starts, [0, 48, 96, 144, 192, 240])
    np.testing.assert_array_equal(v, starts.reshape(2, 3, 1) + np.arange(10))


def test_docstring_examples_run():
    result = doctest.testmod(data, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_folder_of_hidden_and_binary_files_says_what_was_skipped_and_why(tmp_path):
    # Issue 56, item 14: it said only "has no non-empty text file".
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n" * 10)
    (tmp_path / ".notes.txt").write_text("hidden text " * 10)
    (tmp_path / "model.bin").write_bytes(b"\0\1\2" * 10)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(data.DataError) as e:
        data.load_corpus(tmp_path)
    assert str(e.value) == (
        f"--data {str(tmp_path)!r}: the folder has no non-empty text file; skipped 2 hidden "
        "entries (names starting with '.', e.g. '.git'), 1 binary file (a NUL byte in the "
        "first 8 KiB, e.g. 'model.bin') and 1 empty file (e.g. 'empty.txt'); fp8jax train "
        "needs text to read as bytes."
    )


def test_a_device_or_pipe_is_read_as_one_file_not_as_a_folder():
    # --data /dev/null said "the folder has no non-empty text file".
    with pytest.raises(data.DataError, match=r"'/dev/null': the file is empty or binary"):
        data.load_corpus("/dev/null")
