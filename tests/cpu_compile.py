"""The XLA flags of the suite's CPU compiles, for this process and the ones tests start.

The suite compiles well over a thousand small CPU programs, and compiling is
most of its time. LLVM without its optimizations took tests/ops from 345 to
303 s on a 2-core machine; XLA's older CPU loop emitters instead of its MLIR
fusion emitters then halved the backend compile of a tiny train run (7.1 to
3.4 s) and took tests/ops from 584 to 410 s, every test passing both times
(turning the thunk runtime off as well gained nothing: 421 s). Fast-math stays
off; what may differ is last-bit rounding, far below the FP8 numerics budgets.
The two checks made at f32 precision say by how much: gelu_tanh's slope
(tests/kernels/test_activation_cast.py) and two programs' initial parameters
(tests/test_moe_presets.py).

Tests that compare another process's run with one in the test process give
that process these flags too, so both compile the same code.
"""

FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def with_devices(count: int) -> str:
    """``XLA_FLAGS`` for a CPU process with ``count`` fake host devices."""
    return f"--xla_force_host_platform_device_count={count} {FLAGS}"
