"""Test-wide JAX setup: 8 fake CPU devices and strict promotion.

Both environment variables must be set before jax is imported anywhere, which
is why they live at the top of the root conftest.
"""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = f"{_flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402

# Silent upcasts are exactly the bug class fp8jax exists to catch, so tests
# refuse implicit dtype and rank promotion.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
