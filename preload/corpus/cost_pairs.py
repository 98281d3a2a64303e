#!/usr/bin/env python3
"""Runs a program that prints `metric NAME VALUE` lines (launch_sync.cu) in alternating pairs, without and with the
APEX preload, pinned to one core, and prints each metric's medians, the per-pair ratios (plain / preload: above 1
means the preload is faster), their median and range.

    python3 preload/corpus/cost_pairs.py --lib libapex_preload.so [--pairs 5] [--core 3] [--out F.json] -- ./launch_sync 5000
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile


def parse(stdout):
    """{metric: value} from `metric NAME VALUE` lines, and the `result` lines."""
    metrics, results = {}, []
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "metric":
            try:
                metrics[parts[1]] = float(parts[2])
            except ValueError:
                pass
        elif line.startswith("result "):
            results.append(line)
    return metrics, results


def run(cmd, core, lib, stats):
    env = dict(os.environ)
    if lib:
        env["LD_PRELOAD"] = lib
        env["APEX_PRELOAD_STATS"] = stats
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    p = subprocess.run(pin + cmd, env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr[-3000:]}")
    summary = None
    if lib and os.path.exists(stats):
        with open(stats) as f:
            summary = json.load(f)
    return parse(p.stdout) + (summary,)


def table(plain, pre):
    """Rows (metric, plain median, preload median, ratio median, ratio min, ratio max) over the pairs."""
    rows = []
    for name in plain[0]:
        a = [m[name] for m in plain if name in m]
        b = [m[name] for m in pre if name in m]
        ratios = [x / y for x, y in zip(a, b) if y > 0]
        if not ratios:
            continue
        rows.append((name, statistics.median(a), statistics.median(b), statistics.median(ratios), min(ratios), max(ratios)))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--core", type=int, default=3)
    ap.add_argument("--out")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not cmd:
        ap.error("no program given after --")
    tmp = tempfile.mkdtemp(prefix="cost-pairs-")
    plain, pre, summaries, mismatch = [], [], [], False
    first_results = None
    for i in range(a.pairs):
        order = [False, True] if i % 2 == 0 else [True, False]
        for with_lib in order:
            m, results, summary = run(cmd, a.core, a.lib if with_lib else None, os.path.join(tmp, f"s{i}.json"))
            (pre if with_lib else plain).append(m)
            if summary:
                summaries.append(summary)
            if first_results is None:
                first_results = results
            elif results != first_results:
                mismatch = True
                print(f"RESULTS DIFFER in pair {i} ({'preload' if with_lib else 'plain'}):\n{results}\n{first_results}")
    rows = table(plain, pre)
    print(f"| metric (median of each process, ns) | libcuda | preload | libcuda / preload, median | range ({a.pairs} pairs) |")
    print("|---|---|---|---|---|")
    for name, x, y, r, lo, hi in rows:
        print(f"| {name} | {x:.0f} | {y:.0f} | {r:.2f}x | {lo:.2f}-{hi:.2f}x |")
    if summaries:
        s = summaries[-1]
        print("preload stats (last run):", json.dumps({k: v for k, v in s.items() if k != "contexts"}, sort_keys=True))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"cmd": cmd, "plain": plain, "preload": pre, "rows": rows, "stats": summaries}, f, indent=1)
    return 1 if mismatch else 0


if __name__ == "__main__":
    sys.exit(main())
