#!/bin/bash
# M6: packed scale state (two arrays an op) against 2b6e20a's (two a role), alternating processes.
export PYTHONUNBUFFERED=1
R=$PWD
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
ts() { while IFS= read -r l; do echo "$(date +%H:%M:%S) $l"; done; }
mkdir -p /tmp/m6; cd $R/bench
for i in 1 2 3; do
  for lib in old new; do
    src=$R/src; [ $lib = old ] && src=$R/.dev/base/src
    PYTHONPATH=$src:$R/bench XLA_FLAGS="$AT" timeout 90 python3 layer.py --iters 40 --variants bf16 fp8jax_delayed --out /tmp/m6/M6_layer_${lib}_$i.json 2>&1 | flt | ts > /tmp/m6/M6_layer_${lib}_$i.log
  done
done
for lib in old new; do
  src=$R/src; [ $lib = old ] && src=$R/.dev/base/src
  PYTHONPATH=$src:$R/bench XLA_FLAGS="$AT" timeout 120 python3 $R/.dev/outcost.py 2>&1 | flt | ts > /tmp/m6/M6_outcost_$lib.log
done
cd /tmp/m6 && tar czf $OUT/M6.tgz *
for f in /tmp/m6/M6_layer_*.log; do echo "=== $f"; grep "x  \|rror" $f | cut -c1-130 | tail -3; done
for f in /tmp/m6/M6_outcost_*.log; do echo "=== $f"; grep "outputs\|rror" $f | cut -c1-150; done
