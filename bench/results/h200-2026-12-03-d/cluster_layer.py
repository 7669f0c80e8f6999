"""TE layer with the block kernel's CLUSTER set from argv[1]; the rest goes to layer.py."""
import runpy, sys
import fp8jax.kernels.block_gemm as g
g.CLUSTER = int(sys.argv[1])
print("CLUSTER", g.CLUSTER, flush=True)
sys.argv = ["layer.py"] + sys.argv[2:]
runpy.run_path("layer.py", run_name="__main__")
