#!/usr/bin/env python3
"""Runs corpus programs in alternating pairs, without and with the APEX preload, and compares them.

    python3 preload/corpus/pairs.py --lib target/release/libapex_preload.so [--pairs 5] [--core 3]
        [--out results.json] [--extra-env K=V ...] [--preload-env K=V ...] [--timeout 600]
        [--metric step_us|mean_us] [programs ...] [-- program args ...]

Each pair is one process with no LD_PRELOAD at all (plain libcuda) and one with LD_PRELOAD=<lib> and
APEX_PRELOAD_STATS=<a temporary JSON per process>; the order inside a pair alternates (pair 0 plain first, pair 1
preload first, ...) so drift favours neither side. Every process is pinned to one core (or to a list of cores, for
programs that start several processes, whose summaries are merged with a per-process list). Every run's `result`
lines must equal the first plain run's; a mismatch, or a run that fails, makes the runner exit 1 (after all the
programs ran). Only the standard library is used, so the statistics and the table can be tested anywhere
(test_pairs.py).
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_PROGRAMS = ["decode", "train", "compile", "small_ops"]
SIDES = ("plain", "preload")
# The keys the preload's summary is known to have, printed first; any other key is printed generically.
KNOWN_STATS = ("launches", "apex", "fallback", "reasons", "hops_to_cuda", "hops_to_apex", "cpu_syncs")
NOTABLE_STDERR = re.compile(r"panicked at|panicked|RUST_BACKTRACE|apex[-_]preload|stack backtrace", re.IGNORECASE)
MAX_NOTABLE = 25
STDERR_TAIL_LINES = 30
ENV_ITEM = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


# ---------------------------------------------------------------- parsing and comparing


def parse_output(stdout):
    """The `result`, `steps`, `step_us` and `mean_us` lines of a program's stdout.

    Returns {"results": {key: value} in order, "steps", "step_us", "mean_us" (None when absent),
    "extra": [other non-empty lines], "duplicates": [result keys printed twice]}.
    """
    out = {"results": {}, "steps": None, "step_us": None, "mean_us": None, "extra": [], "duplicates": []}
    for raw in stdout.splitlines():
        line = raw.strip()
        if not line:
            continue
        parts = line.split(None, 2)
        head = parts[0]
        try:
            if head == "result" and len(parts) == 3:
                key, value = parts[1], parts[2].strip()
                if key in out["results"]:
                    out["duplicates"].append(key)
                out["results"][key] = value
                continue
            if head == "steps" and len(parts) == 2:
                out["steps"] = int(parts[1])
                continue
            if head in ("step_us", "mean_us") and len(parts) == 2:
                out[head] = float(parts[1])
                continue
        except ValueError:
            pass
        out["extra"].append(line)
    return out


def compare_results(reference, other):
    """The differences between two {key: value} result maps (empty when bitwise identical)."""
    diffs = []
    for key, value in reference.items():
        if key not in other:
            diffs.append(f"{key}: missing (reference {value})")
        elif other[key] != value:
            diffs.append(f"{key}: {other[key]} != reference {value}")
    for key in other:
        if key not in reference:
            diffs.append(f"{key}: not in the reference ({other[key]})")
    return diffs


def notable_stderr(stderr, limit=MAX_NOTABLE):
    """Rust panics and apex-preload lines from a run's stderr: (up to `limit` distinct lines, how many in all)."""
    found = []
    seen = set()
    total = 0
    for line in stderr.splitlines():
        if NOTABLE_STDERR.search(line):
            total += 1
            if line not in seen and len(found) < limit:
                seen.add(line)
                found.append(line)
    return found, total


def tail(text, lines=STDERR_TAIL_LINES):
    return "\n".join(text.splitlines()[-lines:])


# ---------------------------------------------------------------- statistics


def pair_order(index):
    """The sides of pair `index` in the order they run: plain first in even pairs, preload first in odd ones."""
    return SIDES if index % 2 == 0 else SIDES[::-1]


def ratio(plain_us, preload_us):
    """plain / preload: above 1 means the preload is faster. None when either is missing or not positive."""
    if plain_us is None or preload_us is None or plain_us <= 0 or preload_us <= 0:
        return None
    return plain_us / preload_us


def median_range(values):
    """(median, min, max) of the values, or (None, None, None) for none."""
    values = [v for v in values if v is not None]
    if not values:
        return None, None, None
    return statistics.median(values), min(values), max(values)


def run_ok(run):
    return run.get("error") is None


def summarize_program(name, runs, pairs_requested, metric="step_us"):
    """Pairs, ratios, medians, failures and output comparison of one program's runs.

    `runs` are dicts with at least pair, side, error (None when the run succeeded), results, step_us/mean_us,
    stats (the preload's summary or None), notable (stderr lines).
    """
    by_pair = {}
    for run in runs:
        by_pair.setdefault(run["pair"], {})[run["side"]] = run

    pairs = []
    for index in sorted(by_pair):
        sides = by_pair[index]
        plain, preload = sides.get("plain"), sides.get("preload")
        r = None
        if plain and preload and run_ok(plain) and run_ok(preload):
            r = ratio(plain.get(metric), preload.get(metric))
        pairs.append(
            {
                "pair": index,
                "order": list(pair_order(index)),
                "plain_us": plain.get(metric) if plain and run_ok(plain) else None,
                "preload_us": preload.get(metric) if preload and run_ok(preload) else None,
                "ratio": r,
            }
        )
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    ratio_median, ratio_min, ratio_max = median_range(ratios)
    plain_us = [r.get(metric) for r in runs if r["side"] == "plain" and run_ok(r)]
    preload_us = [r.get(metric) for r in runs if r["side"] == "preload" and run_ok(r)]

    failures = [
        {"pair": r["pair"], "side": r["side"], "error": r["error"], "stderr_tail": r.get("stderr_tail", "")}
        for r in runs
        if not run_ok(r)
    ]

    # The reference is the first plain run that succeeded (in run order).
    reference = next((r for r in runs if r["side"] == "plain" and run_ok(r)), None)
    mismatches = []
    compared = 0
    if reference is not None:
        for r in runs:
            if r is reference or not run_ok(r):
                continue
            compared += 1
            diffs = compare_results(reference["results"], r["results"])
            if diffs:
                mismatches.append({"pair": r["pair"], "side": r["side"], "differences": diffs})
    if reference is None:
        identical = None
    else:
        identical = not mismatches

    stats = aggregate_stats([r.get("stats") for r in runs if r["side"] == "preload"])
    # Runs the program's earlier runs advised to take over at the first launch (APEX_PRELOAD_HISTORY): the first
    # preloaded run of a program on a machine never is, so a median over pairs mixes both.
    advised = sum(
        1
        for r in runs
        if r["side"] == "preload" and history_of(r.get("stats")).startswith("advised")
        and "not followed" not in history_of(r.get("stats"))
    )
    missing_stats = sum(1 for r in runs if r["side"] == "preload" and run_ok(r) and r.get("stats") is None)
    # Panic / apex-preload stderr lines of the preload runs, each once, with the pairs it came in.
    notable = []
    by_line = {}
    notable_total = 0
    for r in runs:
        if r["side"] != "preload":
            continue
        notable_total += r.get("notable_total", len(r.get("notable") or []))
        for line in r.get("notable") or []:
            if line not in by_line:
                if len(notable) >= MAX_NOTABLE:
                    continue
                by_line[line] = {"line": line, "pairs": []}
                notable.append(by_line[line])
            by_line[line]["pairs"].append(r["pair"])

    return {
        "program": name,
        "metric": metric,
        "pairs_requested": pairs_requested,
        "pairs_complete": len(ratios),
        "pairs": pairs,
        "ratios": ratios,
        "ratio_median": ratio_median,
        "ratio_min": ratio_min,
        "ratio_max": ratio_max,
        "plain_median_us": median_range(plain_us)[0],
        "preload_median_us": median_range(preload_us)[0],
        "reference": None if reference is None else {"pair": reference["pair"], "results": reference["results"]},
        "compared_runs": compared,
        "identical": identical,
        "mismatches": mismatches,
        "failures": failures,
        "stats": stats,
        "preload_runs_without_stats": missing_stats,
        "advised_runs": advised,
        "notable_stderr": notable,
        "notable_stderr_total": notable_total,
    }


def history_of(stats):
    """What a preload summary says its program's earlier runs advised ("" when it says nothing)."""
    setup = stats.get("setup") if isinstance(stats, dict) else None
    history = setup.get("history") if isinstance(setup, dict) else None
    return history if isinstance(history, str) else ""


def _is_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def aggregate_stats(stats_list):
    """Merges the preload summaries of several runs.

    Returns None when there are none, else {"runs": n, "values": {key: [value per run]}, "reasons":
    {label: {"launches": [per run], "example": first example}}}, keys in first-seen order, known keys first.
    """
    stats_list = [s for s in stats_list if isinstance(s, dict)]
    if not stats_list:
        return None
    keys = [k for k in KNOWN_STATS if any(k in s for s in stats_list) and k != "reasons"]
    for s in stats_list:
        for k in s:
            if k not in keys and k != "reasons":
                keys.append(k)
    values = {k: [s.get(k) for s in stats_list] for k in keys}
    reasons = {}
    for s in stats_list:
        rs = s.get("reasons") or {}
        if not isinstance(rs, dict):
            continue
        for label, info in rs.items():
            entry = reasons.setdefault(label, {"launches": [], "example": None})
            if isinstance(info, dict):
                entry["launches"].append(info.get("launches"))
                if entry["example"] is None and info.get("example"):
                    entry["example"] = info.get("example")
            else:
                entry["launches"].append(info)
    # A reason absent from a run counts 0 there.
    for entry in reasons.values():
        entry["launches"] += [0] * (len(stats_list) - len(entry["launches"]))
    return {"runs": len(stats_list), "values": values, "reasons": reasons}


def format_values(values):
    """One statistic over the runs: the value when all agree, else `median (min-max)`; non-numbers as a set."""
    present = [v for v in values if v is not None]
    if not present:
        return "-"
    if all(_is_number(v) for v in present):
        if len(set(present)) == 1:
            return fmt_num(present[0])
        return f"{fmt_num(statistics.median(present))} ({fmt_num(min(present))}-{fmt_num(max(present))})"
    distinct = []
    for v in present:
        text = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
        if text not in distinct:
            distinct.append(text)
    return " | ".join(distinct)


def fmt_num(v):
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) < 1e15):
        return str(int(v))
    return f"{v:.2f}"


def through_apex(stats):
    """(apex launches, all launches, percent) from aggregated stats, medians over the runs; None if unknown."""
    if not stats:
        return None
    apex = [v for v in stats["values"].get("apex", []) if _is_number(v)]
    launches = [v for v in stats["values"].get("launches", []) if _is_number(v)]
    if not apex or not launches:
        return None
    a, n = statistics.median(apex), statistics.median(launches)
    return a, n, (100.0 * a / n if n else 0.0)


def fmt_us(v):
    return "-" if v is None else f"{v:.1f}"


def fmt_ratio(v):
    return "-" if v is None else f"{v:.3f}"


def table_row(summary):
    through = through_apex(summary["stats"])
    if through is None:
        apex_cell = "no stats"
    else:
        a, n, pct = through
        apex_cell = f"{fmt_num(a)}/{fmt_num(n)} ({pct:.1f}%)"
    if summary["identical"] is None:
        same = "n/a (no plain run)"
    elif summary["identical"]:
        same = f"yes ({summary['compared_runs'] + 1} runs)"
    else:
        same = f"**NO** ({len(summary['mismatches'])} of {summary['compared_runs']} runs differ)"
    pairs = str(summary["pairs_complete"])
    if summary["pairs_complete"] != summary["pairs_requested"] or summary["failures"]:
        pairs = f"{summary['pairs_complete']}/{summary['pairs_requested']} ({len(summary['failures'])} runs failed)"
    if summary["ratio_min"] is None:
        rng = "-"
    else:
        rng = f"{fmt_ratio(summary['ratio_min'])}-{fmt_ratio(summary['ratio_max'])}"
    return [
        summary["program"],
        pairs,
        fmt_us(summary["plain_median_us"]),
        fmt_us(summary["preload_median_us"]),
        fmt_ratio(summary["ratio_median"]),
        rng,
        apex_cell,
        same,
    ]


TABLE_HEADER = [
    "program",
    "pairs",
    "plain µs/step (median)",
    "preload µs/step (median)",
    "ratio median",
    "ratio range",
    "through APEX",
    "outputs identical",
]


def markdown_table(summaries):
    lines = [
        "| " + " | ".join(TABLE_HEADER) + " |",
        "| " + " | ".join("---" for _ in TABLE_HEADER) + " |",
    ]
    for s in summaries:
        lines.append("| " + " | ".join(table_row(s)) + " |")
    return "\n".join(lines)


def format_program_report(summary):
    """The per-program block printed after its runs."""
    s = summary
    out = [f"== {s['program']}: {s['pairs_complete']} complete pairs of {s['pairs_requested']} ({s['metric']})"]
    ratios = " ".join(fmt_ratio(p["ratio"]) for p in s["pairs"])
    out.append(f"  per-pair ratio plain/preload (>1: preload faster): {ratios or '-'}")
    if s["ratio_median"] is not None:
        out.append(
            f"  ratio median {fmt_ratio(s['ratio_median'])}, range {fmt_ratio(s['ratio_min'])}-"
            f"{fmt_ratio(s['ratio_max'])}"
        )
    out.append(
        f"  {s['metric']} median: plain {fmt_us(s['plain_median_us'])} µs, preload {fmt_us(s['preload_median_us'])} µs"
    )
    for p in s["pairs"]:
        out.append(
            f"    pair {p['pair']} ({' then '.join(p['order'])}): plain {fmt_us(p['plain_us'])}, "
            f"preload {fmt_us(p['preload_us'])}, ratio {fmt_ratio(p['ratio'])}"
        )
    if s["identical"] is None:
        out.append("  outputs: NOT COMPARED (no plain run succeeded)")
    elif s["identical"]:
        out.append(f"  outputs: bitwise identical in all {s['compared_runs'] + 1} successful runs")
    else:
        out.append(f"  !!! OUTPUT MISMATCH in {len(s['mismatches'])} of {s['compared_runs']} runs "
                   f"(reference: pair {s['reference']['pair']} plain)")
        for m in s["mismatches"]:
            for d in m["differences"]:
                out.append(f"  !!!   pair {m['pair']} {m['side']}: {d}")
    out.extend(format_stats(s["stats"], s["preload_runs_without_stats"]))
    if s["stats"]:
        out.append(
            f"    earlier runs' advice (APEX_PRELOAD_HISTORY): {s['advised_runs']} of {s['stats']['runs']} preloaded runs "
            "taken over at their first launch"
        )
    if s["notable_stderr"]:
        preload_runs = sorted({r for n in s["notable_stderr"] for r in n["pairs"]})
        out.append(
            f"  preload stderr: {s['notable_stderr_total']} panic / apex-preload lines in "
            f"{len(preload_runs)} runs, {len(s['notable_stderr'])} distinct shown:"
        )
        for n in s["notable_stderr"]:
            out.append(f"    | {n['line']}    [pairs {','.join(map(str, n['pairs']))}]")
    for f in s["failures"]:
        out.append(f"  !!! FAILED: pair {f['pair']} {f['side']}: {f['error']}")
        if f["stderr_tail"]:
            out.append("  !!!   stderr tail:")
            out.extend(f"    | {line}" for line in f["stderr_tail"].splitlines())
    return "\n".join(out)


def format_stats(stats, without_stats=0):
    out = []
    if without_stats:
        out.append(f"  warning: {without_stats} successful preload runs wrote no stats JSON")
    if not stats:
        out.append("  preload stats: none")
        return out
    v = stats["values"]
    through = through_apex(stats)
    head = f"  preload stats ({stats['runs']} runs): launches {format_values(v.get('launches', []))}"
    if through is not None:
        head += f", through APEX {format_values(v.get('apex', []))} ({through[2]:.1f}%)"
    head += f", fallback {format_values(v.get('fallback', []))}"
    out.append(head)
    for label, entry in sorted(stats["reasons"].items(), key=lambda kv: -max(x or 0 for x in kv[1]["launches"])):
        example = f" e.g. {entry['example']!r}" if entry["example"] else ""
        out.append(f"    fallback {label}: {format_values(entry['launches'])}{example}")
    hops = [f"{k} {format_values(v[k])}" for k in ("hops_to_cuda", "hops_to_apex", "cpu_syncs") if k in v]
    if hops:
        out.append("    " + ", ".join(hops))
    others = [f"{k} {format_values(vals)}" for k, vals in v.items() if k not in KNOWN_STATS]
    if others:
        out.append("    " + ", ".join(others))
    return out


# ---------------------------------------------------------------- running


def parse_env_pairs(items, flag):
    env = {}
    for item in items or []:
        if "=" not in item or item.startswith("="):
            raise SystemExit(f"pairs.py: {flag} wants K=V, got {item!r}")
        k, v = item.split("=", 1)
        env[k] = v
    return env


def resolve_program(name):
    p = Path(name)
    candidates = [p, HERE / name, HERE / f"{name}.py"]
    for c in candidates:
        if c.is_file():
            return c.resolve()
    raise SystemExit(f"pairs.py: no program {name!r} (looked for {', '.join(str(c) for c in candidates)})")


def program_name(path):
    return Path(path).stem


def build_run(python, program, prog_args, side, lib, stats_path, core, taskset, env_tool, base_env, extra_env,
              preload_env):
    """The command, environment and preexec function of one run.

    With taskset the preload is set through `env` after it, so only the program (and what it starts) gets
    LD_PRELOAD, not taskset; without taskset the child pins itself with os.sched_setaffinity.
    """
    env = dict(base_env)
    for k in ("LD_PRELOAD", "APEX_PRELOAD_STATS"):
        env.pop(k, None)
    env.update(extra_env)
    env["PYTHONUNBUFFERED"] = "1"
    preload_vars = {}
    if side == "preload":
        preload_vars = dict(preload_env)
        preload_vars["LD_PRELOAD"] = str(lib)
        preload_vars["APEX_PRELOAD_STATS"] = str(stats_path)
    cmd = [python, str(program), *prog_args]
    preexec = None
    if core is not None and taskset:
        prefix = [taskset, "-c", str(core)]
        if preload_vars:
            prefix += [env_tool, *(f"{k}={v}" for k, v in preload_vars.items())]
        cmd = prefix + cmd
    else:
        env.update(preload_vars)
        if core is not None:
            def preexec(c=core):
                os.sched_setaffinity(0, parse_cores(c))
    return cmd, env, preexec, preload_vars


def parse_cores(spec):
    """The cores of a taskset-style list ("3", "3,5", "2-5")."""
    cores = set()
    for part in str(spec).split(","):
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def execute(cmd, env, preexec, timeout):
    """Runs one process in its own session; on timeout kills its whole process group (only what it started)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=preexec,
        start_new_session=True,
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        stdout, stderr = proc.communicate()
    elapsed = time.monotonic() - t0
    return (
        proc.returncode,
        stdout.decode("utf-8", "replace"),
        stderr.decode("utf-8", "replace"),
        timed_out,
        elapsed,
    )


def merge_process_stats(per_process):
    """One run's summary from the summaries its processes wrote (torchrun ranks, multiprocessing workers).

    Processes that made no launch (a launcher, a spawning parent) are left out. One process: its summary
    unchanged. Several: numbers summed, reasons merged (launches summed, the first example kept), other values
    from the first process, and "processes": [{"launches", "apex", "fallback", "attach"} per process], so a
    per-rank share can be checked.
    """
    active = [s for s in per_process if isinstance(s, dict) and s.get("launches")]
    if not active:
        return per_process[0] if per_process else None
    if len(active) == 1:
        return active[0]
    merged = {}
    for s in active:
        for k, v in s.items():
            if k == "reasons" and isinstance(v, dict):
                rs = merged.setdefault("reasons", {})
                for label, info in v.items():
                    e = rs.setdefault(label, {"launches": 0, "example": None})
                    n = info.get("launches", 0) if isinstance(info, dict) else info
                    e["launches"] += n if _is_number(n) else 0
                    if e["example"] is None and isinstance(info, dict):
                        e["example"] = info.get("example")
            elif _is_number(v) and not isinstance(v, bool):
                merged[k] = merged.get(k, 0) + v
            else:
                merged.setdefault(k, v)
    merged["processes"] = [
        {k: s.get(k) for k in ("launches", "apex", "fallback", "attach")} for s in active
    ]
    return merged


def read_process_stats(pattern_path):
    """The summaries written for `pattern_path` (a path with `%p`, one file per process), merged."""
    pattern_path = Path(pattern_path)
    prefix, suffix = pattern_path.name.split("%p", 1)
    found = []
    for f in sorted(pattern_path.parent.glob(f"{prefix}*{suffix}")):
        data, err = read_stats(f)
        if err:
            return None, err
        if data is not None:
            found.append(data)
    if not found:
        return None, None
    return merge_process_stats(found), None


def read_stats(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"unreadable stats JSON {path}: {e}"
    if not isinstance(data, dict):
        return None, f"stats JSON {path} is not an object"
    return data, None


def one_run(ctx, program, pair, side, order_index):
    name = program_name(program)
    stats_path = Path(ctx["tmp"]) / f"stats-{name}-pair{pair}-%p.json"
    for old in Path(ctx["tmp"]).glob(f"stats-{name}-pair{pair}-*.json"):
        old.unlink()
    cmd, env, preexec, preload_vars = build_run(
        ctx["python"], program, ctx["prog_args"], side, ctx["lib"], stats_path, ctx["core"], ctx["taskset"],
        ctx["env_tool"], os.environ, ctx["extra_env"], ctx["preload_env"],
    )
    rc, stdout, stderr, timed_out, elapsed = execute(cmd, env, preexec, ctx["timeout"])
    parsed = parse_output(stdout)
    error = None
    if timed_out:
        error = f"timed out after {ctx['timeout']} s"
    elif rc != 0:
        error = f"exit status {rc}" + (f" (signal {-rc})" if rc < 0 else "")
    elif parsed[ctx["metric"]] is None:
        error = f"printed no {ctx['metric']} line"
    elif not parsed["results"]:
        error = "printed no result lines"
    stats, stats_error = (None, None)
    if side == "preload":
        stats, stats_error = read_process_stats(stats_path)
    notable, notable_total = notable_stderr(stderr) if side == "preload" else ([], 0)
    run = {
        "program": name,
        "pair": pair,
        "side": side,
        "position_in_pair": order_index,
        "cmd": cmd,
        "preload_env": preload_vars,
        "rc": rc,
        "timed_out": timed_out,
        "elapsed_s": round(elapsed, 3),
        "error": error,
        "results": parsed["results"],
        "steps": parsed["steps"],
        "step_us": parsed["step_us"],
        "mean_us": parsed["mean_us"],
        "stdout_extra": parsed["extra"],
        "duplicate_result_keys": parsed["duplicates"],
        "stats": stats,
        "stats_error": stats_error,
        "notable": notable,
        "notable_total": notable_total,
        "stderr_tail": tail(stderr) if error else tail(stderr, 8),
    }
    return run


def progress_line(run, metric):
    value = run.get(metric)
    what = f"{metric} {fmt_us(value)}" if value is not None else "no timing"
    status = "ok" if run["error"] is None else f"FAILED: {run['error']}"
    extra = ""
    if run["stdout_extra"]:
        extra += f"; {len(run['stdout_extra'])} unexpected stdout lines (first: {run['stdout_extra'][0]!r})"
    if run["stats_error"]:
        extra += f"; {run['stats_error']}"
    return (
        f"[{run['program']}] pair {run['pair']} {run['side']:<7}: {what} "
        f"({status}, {run['elapsed_s']:.1f} s){extra}"
    )


def split_passthrough(argv):
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def parse_args(argv):
    own, passthrough = split_passthrough(argv)
    ap = argparse.ArgumentParser(
        description="Alternating plain / preload pairs of the corpus programs.",
        epilog="Arguments after `--` go to every program.",
    )
    ap.add_argument("--lib", required=True, help="the preload library (libapex_preload.so)")
    ap.add_argument("--pairs", type=int, default=5, help="alternating pairs per program (>= 5 advised)")
    ap.add_argument("--core", default="3",
                    help="the core every run is pinned to, or a list for multi-process programs (\"2-5\", \"3,5\")")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the runs to a core")
    ap.add_argument("--out", help="write all raw data here as JSON (default: a file in a temporary folder)")
    ap.add_argument("--extra-env", nargs="*", default=[], metavar="K=V", help="environment for both sides")
    ap.add_argument("--preload-env", nargs="*", default=[], metavar="K=V",
                    help="environment for the preload side only (e.g. APEX_PRELOAD_LOG=info)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--metric", choices=("step_us", "mean_us"), default="step_us",
                    help="which printed timing the ratios use (default step_us)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter that runs the programs")
    ap.add_argument("programs", nargs="*", help=f"programs (default: {' '.join(DEFAULT_PROGRAMS)})")
    args = ap.parse_args(own)
    # `--extra-env K=V prog.py` hands prog.py to --extra-env: what is not K=V there is a program.
    for attr in ("extra_env", "preload_env"):
        items = getattr(args, attr)
        setattr(args, attr, [i for i in items if ENV_ITEM.match(i)])
        args.programs += [i for i in items if not ENV_ITEM.match(i)]
    args.passthrough = passthrough
    return args


def main(argv=None):
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(errors="backslashreplace")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.pairs < 1:
        raise SystemExit("pairs.py: --pairs must be at least 1")
    lib = Path(args.lib)
    if not lib.is_file():
        raise SystemExit(f"pairs.py: no library at {lib}")
    lib = lib.resolve()
    programs = [resolve_program(p) for p in (args.programs or DEFAULT_PROGRAMS)]
    core = None if args.no_pin else args.core
    if core is not None:
        allowed = sorted(os.sched_getaffinity(0))
        try:
            wanted = parse_cores(core)
        except ValueError:
            raise SystemExit(f"pairs.py: --core {core} is not a core list (3, 3,5 or 2-5)")
        if not wanted or not wanted <= set(allowed):
            raise SystemExit(f"pairs.py: core {core} is not one this process may use ({allowed}); pass --core")
    taskset = shutil.which("taskset")
    env_tool = shutil.which("env") or "/usr/bin/env"
    tmp = tempfile.mkdtemp(prefix="apex-pairs-")
    out_path = Path(args.out) if args.out else Path(tmp) / "pairs.json"
    if args.pairs < 5:
        print(f"note: {args.pairs} pairs; these machines are noisy, use >= 5", file=sys.stderr)

    ctx = {
        "python": args.python,
        "prog_args": args.passthrough,
        "lib": lib,
        "core": core,
        "taskset": taskset,
        "env_tool": env_tool,
        "extra_env": parse_env_pairs(args.extra_env, "--extra-env"),
        "preload_env": parse_env_pairs(args.preload_env, "--preload-env"),
        "timeout": args.timeout,
        "metric": args.metric,
        "tmp": tmp,
    }
    pin = "not pinned" if core is None else f"core {core} via {'taskset' if taskset else 'sched_setaffinity'}"
    print(f"lib {lib}; {args.pairs} pairs per program; {pin}; timeout {args.timeout:g} s; metric {args.metric}")
    if args.passthrough:
        print(f"program arguments: {' '.join(args.passthrough)}")

    raw = {
        "lib": str(lib),
        "argv": sys.argv if argv is None else ["pairs.py", *argv],
        "python": args.python,
        "pairs": args.pairs,
        "core": core,
        "pinning": pin,
        "metric": args.metric,
        "extra_env": ctx["extra_env"],
        "preload_env": ctx["preload_env"],
        "program_args": args.passthrough,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "programs": {},
    }
    summaries = []
    for program in programs:
        name = program_name(program)
        runs = []
        for pair in range(args.pairs):
            for position, side in enumerate(pair_order(pair)):
                run = one_run(ctx, program, pair, side, position)
                runs.append(run)
                print(progress_line(run, args.metric), flush=True)
        summary = summarize_program(name, runs, args.pairs, args.metric)
        summaries.append(summary)
        raw["programs"][name] = {"path": str(program), "runs": runs, "summary": summary}
        print(format_program_report(summary), flush=True)
        print(flush=True)

    print(markdown_table(summaries))
    bad = False
    for s in summaries:
        if s["failures"]:
            bad = True
            print(f"!!! {s['program']}: {len(s['failures'])} runs failed", file=sys.stdout)
        if s["identical"] is False:
            bad = True
            print(f"!!! {s['program']}: OUTPUTS DIFFER between runs (see above)", file=sys.stdout)
        if s["identical"] is None:
            bad = True
    raw["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    raw["ok"] = not bad
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(raw, f, indent=2)
    print(f"raw data: {out_path}")
    if args.out:
        shutil.rmtree(tmp, ignore_errors=True)  # the stats files are in the raw data too
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
