"""bench/module_path.py: the modules one FP8 dense forward and backward enter, pinned.

The counts are what the code measures today; a change that makes an op ask
a module again (a helper re-deciding what the op already knows) fails here
(docs/design.md#the-path-of-one-fp8-dense-forward-and-backward).
"""

import functools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parents[2] / "bench"))
import module_path

# Each module of src/fp8jax in the order dense's trace first enters it, and
# the most entries it may take (calls into it from another fp8jax module).
DENSE_PATH = {
    "ops/dense.py": 1,
    "quantize.py": 15,
    "formats.py": 8,
    "ops/dimensions.py": 2,
    "ops/gemm.py": 5,
    "ops/split.py": 2,
    "ops/dot_general.py": 3,
    "recipes.py": 5,
    "ops/fine_grained.py": 1,
    "ops/_partitioning.py": 9,
    "kernels/dispatch.py": 25,
    "ops/residuals.py": 2,
    "ops/quantizing.py": 6,
    "kernels/cast_transpose.py": 31,
    "scaling.py": 3,
    "ops/operand.py": 9,
}


@functools.cache
def _dense_entries():
    return tuple(module_path.trace_entries(*module_path.dense_grad()))


def test_dense_forward_and_backward_enter_each_module_at_most_the_pinned_times():
    entries = _dense_entries()
    path, counts = module_path.path_and_counts(entries)
    assert path == list(DENSE_PATH)
    over = {m: (counts[m], n) for m, n in DENSE_PATH.items() if counts[m] > n}
    assert not over, f"modules entered more often than pinned (entries, pinned): {over}"


def test_dense_enters_dot_general_once_from_outside_and_quantizes_each_operand_once():
    entries = _dense_entries()
    # The public wrapper hands everything to dot_general in one call; the
    # custom_vjp's forward and backward are called back by JAX.
    from_dense = [e.function for e in entries if e.caller == "ops/dense.py"]
    assert from_dense.count("dot_with_bias") == 1
    assert [e.function for e in entries if e.module == "ops/dot_general.py" and e.fresh] == [
        "dot_with_bias", "_fp8_dot_bwd"]  # fmt: skip
    # x and the kernel in the forward, the output gradient in the backward.
    quantized = [e for e in entries if e.function == "quantize_operand"]
    assert [e.caller for e in quantized] == ["ops/dot_general.py"] * 3


def test_an_entry_is_a_call_from_another_module_and_calls_within_one_do_not_count():
    entries = _dense_entries()
    assert entries[0] == module_path.Entry("ops/dense.py", "dense", None, True)
    assert all(e.caller != e.module for e in entries)
    # A Pallas index map called back while cast_transpose runs is an entry,
    # but not a fresh one.
    back = [e for e in entries if e.module == "kernels/cast_transpose.py" and not e.fresh]
    assert back and all(e.caller == "kernels/dispatch.py" for e in back)
