#!/bin/bash
# N1: tile/warp sweep of the activation kernels and cast_transpose (with and without sums).
export PYTHONUNBUFFERED=1
R=$PWD
export PYTHONPATH=$R/src
flt() { grep --line-buffered -v "^W0000\|^I0000\|^E0000\|DeprecationWarning\|warnings.warn"; }
cd .dev
timeout 560 python3 kbench6.py all 2>&1 | flt > $OUT/N1_kbench6.log
python3 - <<'PY'
import os, re, collections
best = collections.defaultdict(list)
for l in open(os.environ["OUT"] + "/N1_kbench6.log"):
    m = re.match(r"(\S+ \S+(?: \S+)?\)?) .* ([\d.]+) ms", l)
    if "ms" in l and "FAILED" not in l:
        key = " ".join(l.split()[:2]) if not l.startswith("ct") else l.split(")")[0] + ") " + l.split()[-4]
        best[key].append((float(l.split(" ms")[0].split()[-1]), l.strip()))
for k, v in best.items():
    v.sort()
    print("BEST", k, "|", v[0][1]); print("   2nd", v[1][1] if len(v) > 1 else "")
PY
grep -c FAILED $OUT/N1_kbench6.log
