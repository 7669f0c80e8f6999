"""The live set at the peak of a scheduled HLO module's entry computation, approximately.

Walks the entry's instructions in schedule order; each result (each tuple
element on its own) is allocated when made and freed after its last use;
bitcasts and get-tuple-elements alias. Control flow bodies are not entered.
Usage: python live_set.py A.hlo.txt [B.hlo.txt ...]; prints the peak and the
live buffers at it, grouped by op_name and type.
"""
import re, sys, collections
DT = {"f32":4,"bf16":2,"f16":2,"s32":4,"u32":4,"f8e4m3fn":1,"f8e5m2":1,"u8":1,"s8":1,"pred":1,"s64":8,"u64":8,"f64":8,"token":0}
SHAPE = re.compile(r"\b(f32|bf16|f16|s32|u32|f8e4m3fn|f8e5m2|u8|s8|pred|s64|u64|f64)\[([0-9,]*)\]")
def nbytes(typestr):
    total = 0
    for dt, dims in SHAPE.findall(typestr):
        n = 1
        for d in dims.split(","):
            if d: n *= int(d)
        total += n * DT[dt]
    return total
tuples, gte_index = {}, {}
def parse(path):
    text = open(path).read()
    entry = text[text.index("\nENTRY"):]
    lines = entry.split("\n")[1:]
    insts = []
    for line in lines:
        line = line.strip()
        if line == "}": break
        m = re.match(r"(ROOT )?%(\S+) = (.*?) (\w[\w-]*)\((.*)$", line)
        if not m: continue
        _, name, typ, op, rest = m.groups()
        # operands: %names before the closing paren of the op call
        depth, i = 1, 0
        while i < len(rest) and depth:
            if rest[i] == "(": depth += 1
            elif rest[i] == ")": depth -= 1
            i += 1
        args = re.findall(r"%([\w.\-]+)", rest[:i])
        meta = re.search(r'op_name="([^"]*)"', rest)
        calls = re.search(r"(calls|custom_call_target)=([%\"]?[\w.$\-]+)", rest)
        if op == "get-tuple-element":
            gte_index[name] = int(re.search(r"index=(\d+)", rest).group(1))
        insts.append((name, typ, op, args, meta.group(1) if meta else "", calls.group(2) if calls else ""))
    return insts
def elements(typ):
    if not typ.startswith("("):
        return [typ]
    inner, depth, cur, out = typ[1:typ.rindex(")")], 0, "", []
    for ch in inner:
        if ch in "([{": depth += 1
        if ch in ")]}": depth -= 1
        if ch == "," and depth == 0:
            out.append(cur); cur = ""
        else:
            cur += ch
    out.append(cur)
    return out
def simulate(insts, top=25):
    root = {}
    size = {}
    owner = {}
    for name, typ, op, args, meta, calls in insts:
        if op == "bitcast" and args:
            root[name] = root.get(args[0], args[0])
        elif op == "get-tuple-element" and args:
            idx = int(re.search(r"index=(\d+)", calls or "") .group(1)) if False else None
            root[name] = root.get(args[0], args[0])
            if isinstance(root[name], str) and root[name] in tuples:
                i = gte_index[name]
                root[name] = (root[name], i)
        else:
            root[name] = name
            els = elements(typ)
            if op not in ("tuple", "parameter") and len(els) > 1:
                tuples[name] = els
                for i, e in enumerate(els):
                    size[(name, i)] = nbytes(e); owner[(name, i)] = name
                size[name] = 0
            else:
                size[name] = 0 if op in ("tuple", "parameter") else nbytes(typ)
            owner[name] = name
    last = {}
    for idx, (name, typ, op, args, meta, calls) in enumerate(insts):
        for a in args:
            if op == "tuple":
                continue
            r = root.get(a, a)
            if r in tuples:  # the whole tuple used
                for i in range(len(tuples[r])): last[(r, i)] = idx
            last[r] = idx
    # tuple members stay live to the end (outputs)
    for a in insts[-1][3]:
        r = root.get(a, a)
        if r in tuples:
            for i in range(len(tuples[r])): last[(r, i)] = len(insts)
        last[r] = len(insts)
    live, cur, peak, peak_at = {}, 0, 0, 0
    frees = collections.defaultdict(list)
    for r, i in last.items(): frees[i].append(r)
    best = None
    for idx, (name, typ, op, args, meta, calls) in enumerate(insts):
        if root[name] == name and size.get(name):
            live[name] = idx; cur += size[name]
        if name in tuples:
            for i in range(len(tuples[name])):
                if (name, i) in last:
                    live[(name, i)] = idx; cur += size[(name, i)]
        if cur > peak:
            peak, peak_at = cur, idx
            best = dict(live)
        for r in frees[idx]:
            if r in live:
                cur -= size[r]; del live[r]
        # never-used values die immediately
        if root[name] == name and name in live and name not in last:
            cur -= size[name]; del live[name]
    return peak, peak_at, best, size
if __name__ == "__main__":
    byname = {}
    for path in sys.argv[1:]:
        tuples.clear(); gte_index.clear()
        insts = parse(path)
        peak, at, best, size = simulate(insts)
        info = {i[0]: i for i in insts}
        print(f"== {path}: {len(insts)} insts, approx peak {peak/2**30:.2f} GiB at #{at} {insts[at][0]} ({insts[at][4][-80:]})")
        groups = collections.Counter()
        for key_n in best:
            n, el = key_n if isinstance(key_n, tuple) else (key_n, None)
            name, typ, op, args, meta, calls = info[n]
            t = typ if el is None else elements(typ)[el]
            key = re.sub(r"\d+", "N", meta.split("/", 1)[-1])[-100:] + f" [{t[:40]}]"
            groups[key] += size[key_n]
        for k, v in groups.most_common(45):
            print(f"  {v/2**30:8.3f}  {k}")
