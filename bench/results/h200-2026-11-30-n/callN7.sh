#!/bin/bash
# N7: the norm kernels' prefetch A/B on one machine: layer.py alternating bc75e26 (new) and its parent (ctl), four processes each.
export PYTHONUNBUFFERED=1
R=$PWD
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
cd bench
for i in 1 2 3 4; do
for v in new ctl; do
if [ $v = new ]; then SRC=$R/src; else SRC=$R/.dev/ctl/src; fi
PYTHONPATH=$SRC:$R/bench XLA_FLAGS="$AT" timeout 60 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --out $OUT/N7_layer_${v}_$i.json 2>&1 | flt | ts > $OUT/N7_layer_${v}_$i.log
done
done
cd $OUT
for f in N7_layer_*.log; do echo "$f $(grep 'fp8jax_delayed   ' $f | cut -c1-120)"; done
tar czf N7.tgz N7_* && rm -f N7_layer_*
