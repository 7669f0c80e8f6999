#!/bin/bash
# N8: a fresh machine: layer.py on HEAD (bc75e26), six processes; nvidia-smi's GPU identity.
export PYTHONUNBUFFERED=1
R=$PWD
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
nvidia-smi --query-gpu=name,serial,uuid,pci.bus_id,power.limit,clocks.max.sm --format=csv > $OUT/N8_gpu.csv 2>&1
cd bench
for i in 1 2 3 4 5 6; do
PYTHONPATH=$R/src:$R/bench XLA_FLAGS="$AT" timeout 60 python3 layer.py --iters 20 --variants bf16 fp8jax_delayed --out $OUT/N8_layer_$i.json 2>&1 | flt | ts > $OUT/N8_layer_$i.log
done
cd $OUT
cat N8_gpu.csv | cut -d, -f1,3-6
for f in N8_layer_*.log; do echo "$f $(grep '  bf16:' $f | cut -c10-60) | $(grep 'fp8jax_delayed   ' $f | cut -c1-100)"; done
tar czf N8.tgz N8_* && rm -f N8_layer_*
