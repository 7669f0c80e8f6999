#!/bin/bash
# F (session 2026-11-30 e): the pre-activation gradient cast to FP8 where it is computed
# (quantize_gradient_recomputed) against the old path (EXP_OLDDG=1: bf16 store + quantize pass),
# same process, alternating, --loss mean. GPU 0: GeGLU; GPU 1: SwiGLU, then the layer.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
mkdir -p $OUT/tr0 $OUT/tr1
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu,linear --loss mean --exps "" "EXP_OLDDG=1" "" "EXP_OLDDG=1" --trace $OUT/tr0 --out $OUT/F_geglu.json 2>&1 | flt > $OUT/F_geglu.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts silu,linear --loss mean --exps "" "EXP_OLDDG=1" "" "EXP_OLDDG=1" --trace $OUT/tr1 --out $OUT/F_swiglu.json 2>&1 | flt > $OUT/F_swiglu.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_OLDDG=1" "" "EXP_OLDDG=1" --trace $OUT/tr1 --out $OUT/F_layer.json 2>&1 | flt > $OUT/F_layer.log ) &
wait
rm -rf $OUT/tr0 $OUT/tr1
tar czf $OUT/atc.tar.gz -C $R/.dev atc
for f in $OUT/F_*.log; do echo "=== $f"; grep "compile\|ms:\|x (\|rror" $f | cut -c1-170 | tail -16; done
