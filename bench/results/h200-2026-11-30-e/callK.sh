#!/bin/bash
# K (session 2026-11-30 e): the pre-activation gradient's cast, transposed copy and bias sums in one
# Pallas kernel (fp8jax.ops.cast_transpose) against XLA's cast + FP8 transpose (EXP_NOCT=1), same
# process, alternating, --loss mean. GPU 0: GeGLU, SwiGLU; GPU 1: the layer, then the GPU tests.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
mkdir -p $OUT/tr0 $OUT/tr1
( cd bench; for a in gelu,linear silu,linear; do CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts $a --loss mean --exps "" "EXP_NOCT=1" "" "EXP_NOCT=1" --trace $OUT/tr0 --out $OUT/K_$a.json 2>&1 | flt > $OUT/K_$a.log; done ) &
( cd bench; CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOCT=1" "" "EXP_NOCT=1" --trace $OUT/tr1 --out $OUT/K_layer.json 2>&1 | flt > $OUT/K_layer.log
  cd $R; XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout $(left) python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py tests/sharding/test_live_gpus.py 2>&1 | flt > $OUT/K_pytest_gpu.log ) &
wait
rm -rf $OUT/tr0 $OUT/tr1
tar czf $OUT/atc.tar.gz -C $R/.dev atc
for f in $OUT/K_*.log; do echo "=== $f"; grep "compile\|ms:\|x (\|rror\|passed\|failed\|cast_transpose" $f | cut -c1-170 | tail -14; done
