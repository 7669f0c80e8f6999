#!/bin/bash
# W: the standard benchmark rows at 32c2f5b (interleaved gated layout), and fp8jax train's
# compile cache: the same small run twice in fresh processes.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-545} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
mkdir -p $OUT/logs
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --activations gelu,linear silu,linear --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --trace /tmp/trW --out $OUT/W_mlp_gated.json 2>&1 | flt | ts > $OUT/logs/W_mlp_gated.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 mlp.py --activations gelu --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --out $OUT/W_mlp_gelu.json 2>&1 | flt | ts > $OUT/logs/W_mlp_gelu.log ) &
( cd $R
  for i in 1 2; do
    CUDA_VISIBLE_DEVICES=1 timeout $(left) python3 -c "import sys; from fp8jax.cli import main; sys.exit(main(sys.argv[1:]))" train --config small --steps 40 --log-every 10 --eval-every 20 --checkpoint-every 40 --out /tmp/run$i --compile-cache /tmp/fp8cc --no-progress 2>&1 | flt | ts > $OUT/logs/W_train$i.log
    cp /tmp/run$i/summary.json $OUT/logs/W_train${i}_summary.json 2>/dev/null
  done
  cd bench
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --trace /tmp/trWl --out $OUT/W_layer.json 2>&1 | flt | ts > $OUT/logs/W_layer.log ) &
wait
cp /tmp/trW/gelu_linear/fp8jax_delayed/compiled.hlo.txt $OUT/W_mlp_geglu_fp8jax_delayed.hlo.txt 2>/dev/null
du -sh /tmp/fp8cc 2>/dev/null
tar czf $OUT/logs.tar.gz -C $OUT logs
for f in $OUT/logs/*.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep -i "ms (\|x \|compile\|summary\|error\|step\|tokens" | cut -c1-180 | tail -25; done
rm -rf $OUT/logs
