"""Test-wide JAX setup: 8 fake CPU devices and strict promotion.

Both environment variables must be set before jax is imported anywhere, which
is why they live at the top of the root conftest.

``FP8JAX_TEST_GPU=1`` is the other mode, for a machine with GPUs: JAX keeps
its GPU platform and only the tests marked ``gpu`` run (the rest assume the
fake CPU devices). Without it, ``gpu`` tests are skipped with that hint.
"""

import os

GPU_MODE = os.environ.get("FP8JAX_TEST_GPU") == "1"
if not GPU_MODE:
    os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

# Silent upcasts are exactly the bug class fp8jax exists to catch, so tests
# refuse implicit dtype and rank promotion.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


def pytest_collection_modifyitems(config, items):
    """Deviceless GPU compiles need fp8jax[verify]; where it is missing, say so.

    A developer without the extra gets every ``deviceless`` test skipped with
    the reason. In CI (``CI`` set) the README's test command installs the
    extra, so a missing toolchain there is a broken install: fail, don't skip.
    """
    import pytest

    from fp8jax.verify import toolchain

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
    try:
        toolchain.check_deviceless()
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        skip = pytest.mark.skip(reason=f"no deviceless GPU compiles here: {e}")
        for item in items:
            if "deviceless" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def compile_cache_reset():
    """Leaves JAX's persistent compilation cache off again after the test."""
    from jax._src import compilation_cache

    yield
    jax.config.update("jax_compilation_cache_dir", None)
    compilation_cache.reset_cache()
