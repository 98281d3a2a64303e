#!/usr/bin/env python3
"""Prints, for each launch of probes/launch_attrs.cu in an apex-trace file, the QMD fields that differ from the
plain launch (grid 8; the cluster launches against the default-policy cluster launch, 30 clusters) and the
methods of the submission that launched it. A cluster launch's QMD counts its grid in clusters."""
import json
import sys

LABELS = {8: "plain", 10: "domain remote", 20: "domain remote again", 22: "default after remote",
          30: "cluster 2", 32: "cluster 2 + spread", 34: "cluster 2 + load balancing", 18: "spread, no cluster",
          24: "remote via swapped map", 26: "default via swapped map"}
IGNORE = ("ADDR", "ADDRESS", "PAYLOAD", "PROGRAM", "GRID_WIDTH", "CTA_RASTER_WIDTH", "_LOWER", "_UPPER")

records = [json.loads(l) for l in open(sys.argv[1])]
launches = {}
last_sub = {}
for r in records:
    if r["type"] == "submission":
        last_sub[r["channel"]] = r
    if r["type"] == "launch" and r.get("kernel") and r["block"][0] == 32 and r["grid"][0] in LABELS:
        launches.setdefault(r["grid"][0], (r, last_sub.get(r["channel"])))
base = dict(launches[8][0]["fields"]) if 8 in launches else {}
for g, (r, sub) in sorted(launches.items(), key=lambda kv: list(LABELS).index(kv[0])):
    f = dict(r["fields"])
    ref = dict(launches[30][0]["fields"]) if g in (32, 34) and 30 in launches else base
    diff = {k: (ref.get(k), v) for k, v in f.items() if ref.get(k) != v and not any(x in k for x in IGNORE)}
    gone = {k: (v, None) for k, v in ref.items() if k not in f and not any(x in k for x in IGNORE)}
    print(f"== grid {g}: {LABELS[g]}  qmd v{r['qmd_version']}")
    for k, v in sorted({**diff, **gone}.items()):
        print(f"   {k}: {v[0]} -> {v[1]}")
    if sub:
        names = [f"{m['name']}={m['value']:#x}" for m in sub["methods"] if not m.get("run")]
        print("   methods:", " ".join(names))
print("fields of the plain launch:", json.dumps(base))
