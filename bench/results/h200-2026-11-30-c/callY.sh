#!/bin/bash
# Y: GeGLU, bf16 and fp8jax delayed, --loss mean and --loss square in separate processes on each GPU
# (GPU 0 mean first, GPU 1 square first): is BF16 slower under the square loss on the same GPU?
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-330} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
m() { CUDA_VISIBLE_DEVICES=$1 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --loss $2 --activations gelu,linear --iters 20 --variants bf16 fp8jax_delayed --out $OUT/Y_gpu$1_$2.json 2>&1 | flt | ts > $OUT/logs/Y_gpu$1_$2.log; }
( m 0 mean; m 0 square ) &
( m 1 square; m 1 mean ) &
wait
tar czf $OUT/logs.tar.gz -C $OUT logs
for f in $OUT/logs/*.log; do echo "=== $f"; grep "ms (\|x  " $f | cut -c1-160; done
rm -rf $OUT/logs
