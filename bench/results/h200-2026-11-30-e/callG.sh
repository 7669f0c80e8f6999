#!/bin/bash
# G (session 2026-11-30 e): why the fused gradient kernel of call F took 5.35 ms: its partial sums had layout {0,1,2}.
# EXP_LC=1 pins {2,1,0} (with_layout_constraint); EXP_NOBLK=1 reduces all rows in one stage (no 128-row blocks);
# EXP_OLDDG=1 is the old path. Same process, alternating, --loss mean.
export PYTHONUNBUFFERED=1
R=$PWD
START=$(date +%s); left() { local l=$(( ${DEADLINE:-560} - ($(date +%s) - START) )); echo $(( l > 1 ? l : 1 )); }
export PYTHONPATH=$R/src:$R/bench
AT="--xla_gpu_per_fusion_autotune_cache_dir=$R/.dev/atc"
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000"; }
cd bench
mkdir -p $OUT/tr0 $OUT/tr1
( CUDA_VISIBLE_DEVICES=0 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts gelu,linear --loss mean --exps "EXP_LC=1" "EXP_NOBLK=1" "EXP_OLDDG=1" "EXP_LC=1" "EXP_NOBLK=1" "EXP_OLDDG=1" --trace $OUT/tr0 --out $OUT/G_geglu.json 2>&1 | flt > $OUT/G_geglu.log ) &
( CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case mlp --acts silu,linear --loss mean --exps "EXP_LC=1" "EXP_NOBLK=1" "EXP_OLDDG=1" "EXP_LC=1" "EXP_NOBLK=1" "EXP_OLDDG=1" --trace $OUT/tr1 --out $OUT/G_swiglu.json 2>&1 | flt > $OUT/G_swiglu.log
  CUDA_VISIBLE_DEVICES=1 XLA_FLAGS="$AT" timeout $(left) python3 $R/.dev/sweep.py --case layer --loss mean --exps "EXP_LC=1" "EXP_OLDDG=1" "EXP_LC=1" "EXP_OLDDG=1" --trace $OUT/tr1 --out $OUT/G_layer.json 2>&1 | flt > $OUT/G_layer.log ) &
wait
rm -rf $OUT/tr0 $OUT/tr1
tar czf $OUT/atc.tar.gz -C $R/.dev atc
for f in $OUT/G_*.log; do echo "=== $f"; grep "compile\|ms:\|x (\|rror" $f | cut -c1-170 | tail -16; done
