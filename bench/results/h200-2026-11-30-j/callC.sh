#!/bin/bash
# 10C: residual passthrough. Phase 1: GPU 0 layer A/B (HEAD / EXP_NORES=1: kernel then XLA's add /
# EXP_NOLN=1: XLA's passes), GPU 1 GPT medium A/B (HEAD / EXP_NOLN=1). Phase 2: layer.py (GPU 0),
# mlp.py (GPU 1). Phase 3: every GPU test, both GPUs.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-575} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout 200 python3 $R/.dev/sweep.py --case layer --loss mean --exps "" "EXP_NORES=1" "EXP_NOLN=1" "" "EXP_NORES=1" "EXP_NOLN=1" --trace /tmp/tr0 --out $OUT/C_layer_ab.json 2>&1 | flt | ts > $OUT/C_layer_ab.log
  CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(( $(left) - 170 )) python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --trace /tmp/fl --out $OUT/C_layer.json 2>&1 | flt | ts > $OUT/C_layer.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout 230 python3 $R/.dev/gpt_ab.py --config medium --mesh "" --exps "" "EXP_NOLN=1" --rounds 1 --out $OUT/C_gpt1_ab.json 2>&1 | flt | ts > $OUT/C_gpt1_ab.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(( $(left) - 170 )) python3 mlp.py --activations silu,linear gelu --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --trace /tmp/fm --out $OUT/C_mlp.json 2>&1 | flt | ts > $OUT/C_mlp.log ) &
wait
cd $R
XLA_FLAGS="$AT" FP8JAX_TEST_GPU=1 timeout $(( $(left) - 5 )) python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | flt > $OUT/C_pytest_gpu.log
tar czf $OUT/atc.tgz .dev/atc
tail -n 3 $OUT/C_pytest_gpu.log
for f in $OUT/C_layer_ab.log $OUT/C_gpt1_ab.log $OUT/C_layer.log $OUT/C_mlp.log; do echo "=== $f"; grep "x (\|x  \|rror\|norm_backward\|add_any\|wrapped_add" $f | cut -c1-170 | tail -24; done
