#!/bin/bash
# L (session 2026-11-30 e): call K again without the GPU tests running next to it (they shared the
# host's CPUs with GPU 0's GeGLU timing): Pallas cast_transpose ("") against XLA's path
# (EXP_NOCT=1), alternating, --loss mean. GPU 0: GeGLU x3; GPU 1: SwiGLU x2, then the layer x2.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-400} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
mkdir -p $OUT/tr0 $OUT/tr1
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu,linear --loss mean --exps "" "EXP_NOCT=1" "" "EXP_NOCT=1" "" "EXP_NOCT=1" --trace $OUT/tr0 --out $OUT/L_geglu.json 2>&1 | flt > $OUT/L_geglu.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts silu,linear --loss mean --exps "" "EXP_NOCT=1" "" "EXP_NOCT=1" --trace $OUT/tr1 --out $OUT/L_swiglu.json 2>&1 | flt > $OUT/L_swiglu.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOCT=1" "" "EXP_NOCT=1" --trace $OUT/tr1 --out $OUT/L_layer.json 2>&1 | flt > $OUT/L_layer.log ) &
wait
rm -rf $OUT/tr0 $OUT/tr1
for f in $OUT/L_*.log; do echo "=== $f"; grep "GPU idle\|x (" $f | cut -c1-170; done
