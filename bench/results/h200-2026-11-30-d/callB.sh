#!/bin/bash
# B (session 2026-11-30 d), working tree = bias inside the custom_vjp (quantize_gradient) + the
# forward activation quantized in one pass under delayed scaling (quantize_recomputed).
# GPU 0: layer sweep (--loss square; EXP_NB=1 = barrier on the saved FP8 normalized input) with the
#        compiled HLO dumped; then layer.py rows, square and mean, next to Flax direct.
# GPU 1: mlp.py rows (GeGLU, SwiGLU), square and mean, next to Flax direct; then one repeat with
#        the same --compile-cache directory (a second process: does the cache load?).
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs $OUT/tr $OUT/hlo
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
CC=/tmp/fp8jax_cc
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
g0() {
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss square --exps "" "EXP_NB=1" "" "EXP_NB=1" --trace $OUT/tr/sw --dump-hlo $OUT/hlo --out $OUT/B_layer_sweep.json 2>&1 | flt | ts > $OUT/logs/B_layer_sweep.log
  for loss in square mean; do
    CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --loss $loss --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --trace $OUT/tr/l$loss --out $OUT/B_layer_$loss.json 2>&1 | flt | ts > $OUT/logs/B_layer_$loss.log
  done
}
g1() {
  for loss in square mean; do
    CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --loss $loss --activations gelu,linear silu,linear --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --compile-cache $CC --trace $OUT/tr/m$loss --out $OUT/B_mlp_$loss.json 2>&1 | flt | ts > $OUT/logs/B_mlp_$loss.log
  done
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --loss square --activations gelu,linear --iters 20 --variants fp8jax_delayed --compile-cache $CC --out $OUT/B_mlp_cc_repeat.json 2>&1 | flt | ts > $OUT/logs/B_mlp_cc_repeat.log
}
g0 & g1 &
wait
tar czf $OUT/logs.tar.gz -C $OUT logs
tar czf $OUT/hlo.tar.gz -C $OUT hlo
tar czf $OUT/atc.tar.gz -C $R/.dev atc
du -sh $CC
rm -rf $OUT/tr $OUT/hlo
for f in $OUT/logs/*.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "compile\|ms:\|x (\|x  \|rror" | cut -c1-175 | tail -16; done
rm -rf $OUT/logs
