"""Test-wide JAX setup: 8 fake CPU devices, unoptimized CPU codegen, strict promotion.

Both environment variables must be set before jax is imported anywhere, which
is why they live at the top of the root conftest.

``FP8JAX_TEST_GPU=1`` is the other mode, for a machine with GPUs: JAX keeps
its GPU platform and only the tests marked ``gpu`` run (the rest assume the
fake CPU devices). Without it, ``gpu`` tests are skipped with that hint.
"""

import atexit
import contextlib
import os
import shutil
import tempfile

import cpu_compile

GPU_MODE = os.environ.get("FP8JAX_TEST_GPU") == "1"
if not GPU_MODE:
    os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    _flags = f"{_flags} --xla_force_host_platform_device_count=8"
# Faster CPU compiles (tests/cpu_compile.py). The deviceless GPU compiles run in
# children with their own XLA_FLAGS (fp8jax.verify.compilation): these never reach them.
if not GPU_MODE and "xla_backend_optimization_level" not in _flags:
    _flags = f"{_flags} {cpu_compile.FLAGS}"
os.environ["XLA_FLAGS"] = _flags.strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# XLA's kernel cache for the deviceless compiles (docs/verify.md#how-the-deviceless-
# compile-works): code generation is most of a deviceless compile, and tests of one
# module often compile the same kernels. One file per process, since XLA rewrites
# the whole file after each compile: each pytest-xdist worker sets its own here (the
# controller's goes unused), in a fresh folder removed at exit.
_kernels = tempfile.mkdtemp(prefix="fp8jax-test-kernels-")
atexit.register(shutil.rmtree, _kernels, True)
os.environ["FP8JAX_VERIFY_KERNEL_CACHE"] = os.path.join(_kernels, "kernels.bin")

# tests/verify/test_deviceless_gate.py runs this conftest's hooks in a pytester session.
pytest_plugins = ["pytester"]

# Silent upcasts are exactly the bug class fp8jax exists to catch, so tests
# refuse implicit dtype and rank promotion.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(config, items):
    """Deviceless GPU compiles need fp8jax[verify]; where it is missing, say so.

    Without the extra (no jax-cuda13-plugin distribution), every
    ``deviceless`` test is skipped with the reason. With the extra installed
    but broken (a version mismatch, no ptxas, no libdevice), the toolchain
    check's error fails every ``deviceless`` test: a skip would hide the
    broken install. In CI (``CI`` set) the README's test command installs the
    extra, so there a missing extra fails too.
    """
    if GPU_MODE:
        cpu_only = pytest.mark.skip(reason="FP8JAX_TEST_GPU=1 runs only the tests marked gpu")
        for item in items:
            if "gpu" not in item.keywords:
                item.add_marker(cpu_only)
        return
    on_gpus = pytest.mark.skip(reason="needs GPUs: FP8JAX_TEST_GPU=1 pytest -m gpu, on GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(on_gpus)
    problem = deviceless_problem()
    if problem is None:
        return
    installed, reason = problem
    if installed or os.environ.get("CI"):
        state = "installed but broken" if installed else "not installed, and CI is set"
        config.stash[_DEVICELESS_BROKEN] = f"fp8jax[verify] is {state}: {reason}"
        return
    skip = pytest.mark.skip(reason=f"fp8jax[verify] is not installed: {reason}")
    for item in items:
        if "deviceless" in item.keywords:
            item.add_marker(skip)


_DEVICELESS_BROKEN = pytest.StashKey[str]()


def deviceless_problem(check=None) -> tuple[bool, str] | None:
    """None if deviceless compiles can run, else (extra installed, the check's error).

    Installed means the ``jax-cuda13-plugin`` distribution is present; the
    check is ``fp8jax.verify.toolchain.check_deviceless`` (``check`` replaces
    it in tests of this function).
    """
    from fp8jax.verify import toolchain

    try:
        (check or toolchain.check_deviceless)()
    except ImportError as e:
        return toolchain.distribution_version(toolchain.PLUGIN) is not None, str(e)
    return None


def pytest_runtest_setup(item):
    reason = item.config.stash.get(_DEVICELESS_BROKEN, None)
    if reason is not None and "deviceless" in item.keywords:
        pytest.fail(reason, pytrace=False)


@contextlib.contextmanager
def _every_program_cached():
    """JAX's persistent compilation cache writes every program, and is off afterwards.

    JAX writes only programs that took ``jax_persistent_cache_min_compile_time_secs``
    (1 s) to compile; on a CPU a small run's programs take about that long, so
    whether anything was written depended on the machine's speed: a faster CI
    machine wrote nothing. Inside, the threshold is 0.
    """
    from jax.experimental.compilation_cache import compilation_cache

    threshold = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", None)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", threshold)
        compilation_cache.reset_cache()


@pytest.fixture
def compile_cache_reset():
    """A test that turns JAX's persistent compilation cache on; every program is
    written (``_every_program_cached``), and the cache is off again after it."""
    with _every_program_cached():
        yield


@pytest.fixture(scope="module")
def shared_compile_cache(tmp_path_factory):
    """JAX's persistent compilation cache, on for one test module; its directory.

    Every ``fp8jax.training.train`` call jits its own step, so two runs of one
    configuration compile the same program twice: most of a short run's time
    on a CPU. With the cache on, the second run loads the first one's
    executable instead, as ``fp8jax train --compile-cache`` does on a GPU.
    The cache is the module's own (a fresh directory; under pytest-xdist, per
    worker) and is off again after the module.
    """
    from fp8jax import compile_cache

    with _every_program_cached():
        yield compile_cache.enable(str(tmp_path_factory.mktemp("jax-cache")))


@pytest.fixture
def one_device():
    """A one-device mesh as context, for the live single-GPU tests.

    With several GPUs visible and no mesh, the ops cannot tell a one-device
    ``jit`` from a sharded one and keep XLA's cast (kernels.dispatch.is_local);
    on 2 H200s the kernel assertions of tests/ops/test_layernorm_dense.py then failed (run 8A).
    """
    with jax.set_mesh(jax.make_mesh((1,), ("one",), devices=jax.devices()[:1])) as mesh:
        yield mesh
