"""fp8jax.compile_cache: where the persistent compilation cache goes, and that it is used."""

import os

import jax
import pytest

from fp8jax import compile_cache
from fp8jax.training import TrainOptions, train
from fp8jax.training.errors import ConfigError


def test_auto_means_the_default_directory_on_a_gpu_and_no_cache_elsewhere(monkeypatch):
    monkeypatch.delenv("FP8JAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere")
    assert compile_cache.resolve("auto", backend="gpu") == "/somewhere/fp8jax/jax"
    assert compile_cache.resolve(None, backend="gpu") == "/somewhere/fp8jax/jax"
    assert compile_cache.resolve("auto", backend="cpu") is None
    monkeypatch.setenv("FP8JAX_CACHE_DIR", "/mine")
    assert compile_cache.resolve("auto", backend="gpu") == "/mine"


def test_none_and_a_directory_are_taken_as_said_and_an_empty_string_is_refused():
    assert compile_cache.resolve("none", backend="gpu") is None
    assert compile_cache.resolve("/tmp/c", backend="cpu") == "/tmp/c"
    with pytest.raises(ValueError, match="'auto', 'none' or a directory"):
        compile_cache.resolve("  ", backend="gpu")


def test_enable_creates_the_directory_and_points_jax_at_it(tmp_path, compile_cache_reset):
    where = tmp_path / "a" / "b"
    assert compile_cache.enable(str(where)) == str(where)
    assert where.is_dir()
    assert jax.config.jax_compilation_cache_dir == str(where)


def test_a_second_directory_receives_the_programs_compiled_after_it(tmp_path, compile_cache_reset):
    # JAX opens its cache once, at the first compile that finds a directory; a
    # directory set later was ignored and the programs went on to the first one.
    first, second = tmp_path / "first", tmp_path / "second"
    compile_cache.enable(str(first))
    jax.jit(lambda x: x + 1)(jax.numpy.ones(3)).block_until_ready()
    written = set(os.listdir(first))
    compile_cache.enable(str(second))
    jax.jit(lambda x: x * 3 - 1)(jax.numpy.ones(5)).block_until_ready()
    assert written and os.listdir(second), "the second directory received nothing"
    assert set(os.listdir(first)) == written


def test_a_directory_that_cannot_be_made_is_a_config_error(tmp_path, compile_cache_reset):
    blocker = tmp_path / "file"
    blocker.write_text("")
    options = TrainOptions(out=str(tmp_path / "run"), compile_cache=str(blocker / "cache"))
    with pytest.raises(ConfigError, match="--compile-cache: compile_cache: cannot create"):
        train(options, progress=False, say=lambda _: None)
    assert not (tmp_path / "run").exists()


def test_a_train_run_writes_its_compiled_programs_to_the_cache(tmp_path, compile_cache_reset):
    cache = tmp_path / "cache"
    messages = []
    options = TrainOptions(
        out=str(tmp_path / "run"), compile_cache=str(cache), steps=2, batch_size=2, seq_len=32,
        log_every=1, eval_every=2, eval_batches=1, checkpoint_every=2,
    )  # fmt: skip
    train(options, progress=False, say=messages.append)
    assert f"compile cache: {cache}" in messages
    assert os.listdir(cache), "no compiled program was written to the cache"
