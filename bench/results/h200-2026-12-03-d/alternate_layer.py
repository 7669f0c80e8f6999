"""layer.py with the block kernel's warpgroups alternating (argv[1] == 'alternate') or not."""
import functools, runpy, sys
import fp8jax.kernels.block_gemm as g
if sys.argv[1] != "alternate":
    g.mosaic_block_matmul = functools.partial(g.mosaic_block_matmul, alternate=False)
print("mode", sys.argv[1], flush=True)
sys.argv = ["layer.py"] + sys.argv[2:]
runpy.run_path("layer.py", run_name="__main__")
