#!/bin/bash
# N2: the gated/gelu gradient kernel's tiles; the layer's rows with the sums dropped where unused (four processes).
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
(cd .dev && timeout 200 python3 kbench6.py grad2 2>&1 | flt > $OUT/N2_kbench6_grad2.log)
cd bench
XLA_FLAGS="$AT" timeout 150 python3 layer.py --iters 20 --variants bf16 flax_fp8_direct fp8jax_delayed --trace /tmp/layer --out $OUT/N2_layer.json 2>&1 | flt | ts > $OUT/N2_layer.log
for i in 2 3 4; do
XLA_FLAGS="$AT" timeout 60 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --out $OUT/N2_layer_$i.json 2>&1 | flt | ts > $OUT/N2_layer_$i.log
done
cd $OUT && grep -h "  fp8jax_delayed:\|  flax_fp8_direct:\|  bf16:\|fp8jax_delayed   \|flax_fp8_direct   \|quantize" N2_layer*.log | cut -c1-190
tar czf N2.tgz N2_* && rm -f N2_layer*.json N2_layer_*.log
