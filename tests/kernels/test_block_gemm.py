"""The block-scaled GEMM kernel's build options: interpret mode, the tile table, registers.

The GPU comparison and the FP8 ``wgmma`` of the default build are in
tests/ops/test_fine_scaling.py; here each :class:`KernelConfig` option is run
in Mosaic GPU's interpret mode against XLA's sums and compiled for the H200.
"""

import functools
import re
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.kernels import block_gemm
from fp8jax.kernels.block_gemm import KernelConfig
from mosaic_gpu_testing import h200_compiles_with_dumps, one_compile_per_thread_body

B = block_gemm.BLOCK


@pytest.fixture(scope="module", autouse=True)
def _one_compile_per_thread_body():
    with one_compile_per_thread_body():  # its docstring says why
        yield


def _exact_operands(batch, m, n, k, b_blocks, seed=0):
    """Operands whose block-scaled sums are exact in f32, in any order, fused or not.

    FP8 integers in [-8, 8] (exact in E4M3) make each slice's product an
    integer below 2**13; scales 2**-2..2**2 shift it without rounding, and three
    slices stay below 2**19 with no bit under 2**-4: 23 bits. So the kernel
    and XLA agree bit for bit exactly when every product meets its own
    scales, whatever the order of the adds and whether the compiler fuses a
    multiply into an add (XLA on the CPU does in the kernel's step).
    """
    rng = np.random.default_rng(seed)

    def fp8(shape):
        return jnp.asarray(rng.integers(-8, 9, shape).astype(np.float32)).astype(jnp.float8_e4m3fn)

    def scales(shape):
        return jnp.asarray(np.exp2(rng.integers(-2, 3, shape)).astype(np.float32))

    b_rows = n // B if b_blocks else n
    return (
        fp8((batch, m, k)),
        fp8((batch, n, k)),
        scales((batch, m, k // B)),
        scales((batch, b_rows, k // B)),
    )


INTERPRET_CASES = {
    # name: (b_blocks, batch, n, config); m = 256 and k = 384 (3 slices) in each.
    "blocks-default": (True, 2, 128, KernelConfig()),
    "blocks-n64": (True, 1, 128, KernelConfig(tile_n=64)),
    "rows-default": (False, 1, 128, KernelConfig()),
    "rows-late-scales-n192": (False, 1, 192, KernelConfig(scales_first=False, tile_n=192)),
    "blocks-pingpong": (True, 1, 128, KernelConfig(pingpong=True)),
}


@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_block_kernel_is_bitwise_xlas_sums_in_interpret_mode(case):
    """Each build option, two CTAs walking several tiles, equal to XLA's sums bit for bit."""
    b_blocks, batch, n, config = INTERPRET_CASES[case]
    ops = _exact_operands(batch, 256, n, 384, b_blocks)
    kernel = functools.partial(block_gemm.mosaic_block_matmul, out_dtype=jnp.float32,
                               b_blocks=b_blocks, config=config, sms=2, interpret=True)  # fmt: skip
    xla = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32,
                                    b_blocks=b_blocks))  # fmt: skip
    y, expected = np.asarray(kernel(*ops)), np.asarray(xla(*ops))
    assert np.abs(expected).max() > 2**10  # not a sum of zeros
    np.testing.assert_array_equal(y, expected)


def test_interpret_mode_check_sees_a_wrong_scale():
    """The comparison above fails when one slice's scales are another's."""
    qa, qb, sa, sb = _exact_operands(1, 256, 128, 384, b_blocks=True)
    xla = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32,
                                    b_blocks=True))  # fmt: skip
    shifted = jnp.roll(sa, 1, axis=2)
    assert not np.array_equal(xla(qa, qb, sa, sb), xla(qa, qb, shifted, sb))


def test_tile_table_fills_the_sms():
    """DeepGEMM's rule: the fewest waves of tiles, each tile weighed by its columns."""
    # 8192^3: 4096 tiles of 128 in 32 waves beat 8192 tiles of 64 in 63.
    assert block_gemm.tile_n_for(8192, 8192, b_blocks=True) == 128
    # Four tiles of 128 leave 128 of 132 SMs idle; eight of 64 finish sooner.
    assert block_gemm.tile_n_for(256, 256, b_blocks=True) == 64
    # A wgrad's per-row scales allow 192 columns: 1024 tiles (8 waves) against
    # 1536 (12 waves) of 128; not with scales first, where 192 spills.
    assert block_gemm.tile_n_for(8192, 3072, b_blocks=False, scales_first=False) == 192
    assert block_gemm.tile_n_for(8192, 3072, b_blocks=False) == 128
    # 192 does not divide 8192; block scales never take a tile past one block.
    assert block_gemm.tile_n_for(8192, 8192, b_blocks=False) == 128
    assert block_gemm.tile_n_for(8192, 3072, b_blocks=True) == 128
    # Even with late scales, where per-row scales take 192, a block-scaled tile
    # stays within one 128-wide block: 192 would straddle two blocks' scales.
    assert block_gemm.tile_n_for(8192, 3072, b_blocks=True, scales_first=False) == 128
    # More SMs, fewer waves: the table reads the device's count.
    assert block_gemm.tile_n_for(256, 256, b_blocks=True, sms=4) == 128


def test_kernel_config_is_static_and_checked():
    assert hash(KernelConfig()) == hash(KernelConfig(scales_first=True, tile_n=None))
    assert KernelConfig() != KernelConfig(scales_first=False)
    with pytest.raises(ValueError, match=r"tile_n=\.\.\.\) must be None or one of .*got 100"):
        KernelConfig(tile_n=100)
    with pytest.raises(ValueError, match=r"tile_n=192\) spills registers with scales_first"):
        KernelConfig(tile_n=192)
    with pytest.raises(ValueError, match=r"stages=\.\.\.\) must be in \[2, 6\], got 1"):
        KernelConfig(stages=1)
    ops = _exact_operands(1, 256, 192, 128, b_blocks=True)
    wide = KernelConfig(scales_first=False, tile_n=192)
    with pytest.raises(ValueError, match=r"tile_n=192\) must divide n=192 and the weight's block"):
        block_gemm.mosaic_block_matmul(*ops, out_dtype=jnp.float32, b_blocks=True, config=wide)


def _args(batch, m, n, k, b_blocks):
    b_scales = (batch, n // B, k // B) if b_blocks else (batch, n, k // B)
    f8 = jnp.float8_e4m3fn
    return (jax.ShapeDtypeStruct((batch, m, k), f8), jax.ShapeDtypeStruct((batch, n, k), f8),
            jax.ShapeDtypeStruct((batch, m, k // B), jnp.float32),
            jax.ShapeDtypeStruct(b_scales, jnp.float32))  # fmt: skip


DEVICELESS_CASES = {
    "blocks-default": (True, 384, KernelConfig()),
    "blocks-late-scales": (True, 384, KernelConfig(scales_first=False)),
    "rows-default": (False, 384, KernelConfig()),
    "rows-late-scales-n192": (False, 384, KernelConfig(scales_first=False, tile_n=192)),
    "blocks-pingpong": (True, 384, KernelConfig(pingpong=True)),
}


@pytest.fixture(scope="module")
def h200_with_ptx(tmp_path_factory):
    """H200 compiles with each kernel's PTX (mosaic_gpu_testing)."""
    return h200_compiles_with_dumps(tmp_path_factory, {"MOSAIC_GPU_DUMP_PTX": "1"})


@pytest.mark.deviceless
@pytest.mark.parametrize("case", DEVICELESS_CASES)
def test_deviceless_block_kernel_builds_fit_the_registers(case, tmp_path, h200_with_ptx):
    """Each build compiles for the H200 to FP8 wgmma of its tile, with no register spilled."""
    from fp8jax.verify import toolchain

    b_blocks, n, config = DEVICELESS_CASES[case]
    fn = functools.partial(block_gemm.mosaic_block_matmul, out_dtype=jnp.bfloat16,
                           b_blocks=b_blocks, config=config)  # fmt: skip
    # Each case is another build of the kernel: one child compiles them all.
    _, dumps = h200_with_ptx(fn, *_args(1, 256, n, 512, b_blocks), child="builds")
    (ptx,) = dumps.glob(f"{block_gemm.KERNEL_NAME}*.ptx")
    tile_n = config.tile_n or block_gemm.tile_n_for(
        256, n, b_blocks, scales_first=config.scales_first
    )
    text = ptx.read_text()
    assert re.search(rf"wgmma\.mma_async\.sync\.aligned\.m64n{tile_n}k32\.f32\.e4m3\.e4m3", text)
    ptxas = next(root / "bin" / "ptxas" for root in toolchain.cuda_roots()
                 if (root / "bin" / "ptxas").is_file())  # fmt: skip
    info = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(ptx), "-o", str(tmp_path / "k")],
                          capture_output=True, text=True, check=True).stderr  # fmt: skip
    registers = int(re.search(r"Used (\d+) registers", info).group(1))
    assert "0 bytes spill stores, 0 bytes spill loads" in info, info
    # Two compute warpgroups at most 232 registers a thread beside the memory one's 40.
    assert registers <= 232, info


@pytest.mark.gpu
@pytest.mark.parametrize("sms", [None, 5], ids=["all-sms", "5-ctas"])
@pytest.mark.parametrize("case", INTERPRET_CASES)
def test_block_kernel_builds_are_xlas_sums_on_the_gpu(case, sms):
    """On FP8 tensor cores too: the exact operands leave no rounding to tell them apart."""
    b_blocks, batch, n, config = INTERPRET_CASES[case]
    ops = _exact_operands(batch, 512, n, 384, b_blocks)
    kernel = jax.jit(functools.partial(block_gemm.mosaic_block_matmul, out_dtype=jnp.float32,
                                       b_blocks=b_blocks, config=config, sms=sms))  # fmt: skip
    xla = jax.jit(functools.partial(block_gemm.xla_block_matmul, out_dtype=jnp.float32,
                                    b_blocks=b_blocks))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(kernel(*ops)), np.asarray(xla(*ops)))
