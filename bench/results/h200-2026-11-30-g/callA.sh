#!/bin/bash
# A7 (session 2026-11-30 g): the QKV split inside layernorm_dense. GPU 0: layer, mean loss, alternating:
# "" (split, the gradient's cast reads dq/dk/dv), EXP_NOSPLIT=1 (sliced outside, as before), EXP_FWD3=1
# (split + one forward GEMM per piece). GPU 1: GPU tests of the ops, then the layer rows.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
mkdir -p /tmp/tr0
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NOSPLIT=1" "EXP_FWD3=1" "" "EXP_NOSPLIT=1" "EXP_FWD3=1" --trace /tmp/tr0 --out $OUT/A_layer_ab.json 2>&1 | flt > $OUT/A_layer_ab.log ) &
( cd $R; CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_fused.py 2>&1 | flt > $OUT/A_pytest_gpu.log
  cd bench; CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed \
    --out $OUT/A_layer.json 2>&1 | flt | ts > $OUT/A_layer.log ) &
wait
tar czf $OUT/atc.tgz -C $R/.dev atc
tail -1 $OUT/A_pytest_gpu.log
echo "=== ab"; grep "x (\|rror\|compile" $OUT/A_layer_ab.log | cut -c1-170
grep -A14 "^\[base\]" $OUT/A_layer_ab.log | head -16
for f in $OUT/A_layer.log; do echo "=== $f"; grep -v "Traceback\|File \"" $f | grep "x  \|rror" | cut -c1-170 | tail -14; done
