"""Probe: block-scaled FP8 GEMM in Mosaic GPU, warp specialized."""
import functools
import jax, jax.numpy as jnp
from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu

BLOCK = 128


def _bcast(v, shape, dim):
    return lax.broadcast_in_dim(v, shape, [dim])


def kernel(a_gmem, b_gmem, sa_gmem, sb_gmem, out_gmem, *, tile_m, tile_n, stages, group, b_scalar, overlap):
    m, k = a_gmem.shape
    n = b_gmem.shape[0]
    cta_m = 2 * tile_m
    per_step = 2 if overlap else 1
    m_iters, n_iters, k_iters = m // cta_m, n // tile_n, k // (BLOCK * per_step)
    swz = plgpu.find_swizzle(BLOCK * 8)
    tr = (plgpu.TilingTransform((8, swz)), plgpu.SwizzleTransform(swz))
    epi_n = 64
    out_swz = plgpu.find_swizzle(epi_n * 16)
    out_tr = (plgpu.TilingTransform((8, out_swz // 2)), plgpu.SwizzleTransform(out_swz))
    shape = (tile_m, tile_n)

    def operand_specs(rows, j, release):
        return plgpu.BlockSpec((rows, BLOCK), lambda kk: (0, per_step * kk + j), transforms=tr, delay_release=release)

    if overlap:
        specs = [operand_specs(cta_m, 0, 1), operand_specs(cta_m, 1, 1), operand_specs(tile_n, 0, 1), operand_specs(tile_n, 1, 1)]
    else:
        specs = [operand_specs(cta_m, 0, 0), operand_specs(tile_n, 0, 0)]
    rel = 1 if overlap else 0
    specs += [plgpu.BlockSpec((per_step, cta_m), lambda kk: (kk, 0), delay_release=rel), plgpu.BlockSpec((per_step, tile_n), lambda kk: (kk, 0), delay_release=rel)]

    def pipeline(body, ctx):
        return plgpu.emit_pipeline_warp_specialized(
            body, grid=(k_iters,), memory_registers=40, in_specs=specs,
            wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages,
            compute_context=ctx)

    ignore = lambda *_, **__: None
    n_ops = 4 if overlap else 2

    @functools.partial(
        pl.run_scoped,
        allocs=pipeline(ignore, ignore).get_allocations(*([a_gmem] * (n_ops // 2) + [b_gmem] * (n_ops // 2)), sa_gmem, sb_gmem),
        out_smem=plgpu.SMEM((2, tile_m, epi_n), out_gmem.dtype, transforms=out_tr),
        collective_axes="wg",
    )
    def scope(allocs, out_smem):
        wg = lax.axis_index("wg")

        @plgpu.nd_loop((m_iters * n_iters,), collective_axes="sm")
        def mn_loop(info):
            (lin,) = info.index
            mi, ni = plgpu.planar_snake(lin, (m_iters, n_iters), 1, group)
            m_sl = pl.ds(mi * cta_m, cta_m)
            n_sl = pl.ds(ni * tile_n, tile_n)
            wg_m = pl.ds(wg * tile_m, tile_m)

            def scale(sa_s, sb_s, j):
                sa = sa_s[j, wg_m]
                if b_scalar:
                    return _bcast(sa * sb_s[j, 0], shape, 0)
                return _bcast(sa, shape, 0) * _bcast(sb_s[j, :], shape, 1)

            def epilogue(acc):
                out = acc.astype(out_gmem.dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                for e in range(tile_n // epi_n):
                    out_smem[wg] = out[:, e * epi_n:(e + 1) * epi_n]
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[m_sl, n_sl].at[wg_m, pl.ds(e * epi_n, epi_n)])
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

            zeros = jnp.zeros(shape, jnp.float32)
            if not overlap:
                def ctx(run):
                    epilogue(run(zeros))

                def body(idx, a_s, b_s, sa_s, sb_s, acc):
                    def product(t):
                        plgpu.wgmma(t, a_s.at[wg_m], plgpu.transpose_ref(b_s, (1, 0)))
                        return t[...]
                    p = pl.run_scoped(product, plgpu.ACC(shape, jnp.float32))
                    return acc + p * scale(sa_s, sb_s, 0)
            else:
                def ctx(run):
                    def scoped(t0, t1):
                        _, t1_, acc, s_prev = run((t0, t1, zeros, zeros))
                        last = plgpu.wgmma_accumulator_load(t1_, wait_n=0)
                        epilogue(acc + last * s_prev)
                    pl.run_scoped(scoped, plgpu.ACC(shape, jnp.float32), plgpu.ACC(shape, jnp.float32))

                def body(idx, a0, a1, b0, b1, sa_s, sb_s, carry):
                    t0, t1, acc, s_prev = carry
                    plgpu.wgmma(t0, a0.at[wg_m], plgpu.transpose_ref(b0, (1, 0)))
                    p1 = plgpu.wgmma_accumulator_load(t1, wait_n=1)
                    acc = acc + p1 * s_prev
                    t1[...] = zeros
                    plgpu.wgmma(t1, a1.at[wg_m], plgpu.transpose_ref(b1, (1, 0)))
                    p0 = plgpu.wgmma_accumulator_load(t0, wait_n=1)
                    acc = acc + p0 * scale(sa_s, sb_s, 0)
                    t0[...] = zeros
                    return t0, t1, acc, scale(sa_s, sb_s, 1)

            ops = ([a_gmem.at[m_sl]] * (n_ops // 2)) + ([b_gmem.at[n_sl]] * (n_ops // 2))
            pipeline(body, ctx)(*ops, sa_gmem.at[:, m_sl], sb_gmem.at[:, n_sl], allocations=allocs)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def matmul(a, b, sa_t, sb_t, *, tile_m=64, tile_n=128, stages=4, sms=132, group=8, out_dtype=jnp.bfloat16,
           b_scalar=False, overlap=False):
    m, k = a.shape
    n = b.shape[0]
    f = plgpu.kernel(
        functools.partial(kernel, tile_m=tile_m, tile_n=tile_n, stages=stages, group=group, b_scalar=b_scalar, overlap=overlap),
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(sms,), grid_names=("sm",),
        num_threads=3, thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return f(a, b, sa_t, sb_t)


def factory(mesh, m=8192, n=8192, k=8192, **kw):
    args = (jax.ShapeDtypeStruct((m, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((k // 128, m), jnp.float32), jax.ShapeDtypeStruct((k // 128, n), jnp.float32))
    return functools.partial(matmul, **kw), args

factory_scalar = functools.partial(factory, b_scalar=True)
factory_overlap = functools.partial(factory, overlap=True, stages=3)
factory_overlap_scalar = functools.partial(factory, overlap=True, b_scalar=True, stages=3)
