"""Print the kernels of a chrome trace by total time, full names (probe)."""
import collections
import gzip
import json
import sys

doc = json.load(gzip.open(sys.argv[1]))
tot = collections.Counter()
cnt = collections.Counter()
for ev in doc["traceEvents"] if isinstance(doc, dict) else doc:
    if ev.get("cat") == "kernel":
        tot[ev["name"]] += ev.get("dur", 0)
        cnt[ev["name"]] += 1
for name, us in tot.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 12):
    print(f"{us / 1000:9.2f} ms {cnt[name]:5d}  {name[:220]}")
