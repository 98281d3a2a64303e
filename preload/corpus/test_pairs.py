"""Tests of pairs.py without a GPU: its functions, and the runner end to end against fake programs.

    python3 -m unittest preload/corpus/test_pairs.py      (from the repository root)
    python3 -m unittest test_pairs                         (from preload/corpus)

The fake programs print `result` / `step_us` lines from a JSON config beside them, write a fake stats JSON to
$APEX_PRELOAD_STATS when LD_PRELOAD is set, and log the side, the environment and their CPU affinity, so the
tests can check the order of the sides, the pinning and the environment of each run. `--lib` is the system libc,
a harmless library to preload.
"""

import ctypes.util
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAIRS = HERE / "pairs.py"

_spec = importlib.util.spec_from_file_location("apex_corpus_pairs", PAIRS)
pairs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pairs)


def find_libc():
    for c in (
        "/lib/x86_64-linux-gnu/libc.so.6",
        "/usr/lib/x86_64-linux-gnu/libc.so.6",
        "/lib/aarch64-linux-gnu/libc.so.6",
        "/usr/lib/aarch64-linux-gnu/libc.so.6",
        "/lib64/libc.so.6",
        "/usr/lib64/libc.so.6",
    ):
        if os.path.isfile(c):
            return c
    name = ctypes.util.find_library("c")
    for d in ("/lib", "/usr/lib", "/lib64", "/usr/lib64"):
        if name and os.path.isfile(os.path.join(d, name)):
            return os.path.join(d, name)
    return None


LIBC = find_libc()

FAKE = textwrap.dedent(
    '''
    import json, os, sys
    from pathlib import Path

    me = Path(__file__)
    config = json.loads(me.with_suffix(".json").read_text())
    side = "preload" if os.environ.get("LD_PRELOAD") else "plain"
    counter = me.with_suffix(f".{side}.count")
    n = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(n + 1))
    with open(me.with_suffix(".log"), "a") as log:
        log.write(json.dumps({
            "side": side,
            "index": n,
            "affinity": sorted(os.sched_getaffinity(0)),
            "ld_preload": os.environ.get("LD_PRELOAD"),
            "stats": os.environ.get("APEX_PRELOAD_STATS"),
            "unbuffered": os.environ.get("PYTHONUNBUFFERED"),
            "extra": os.environ.get("FAKE_EXTRA"),
            "argv": sys.argv[1:],
        }) + "\\n")
    if config.get("fail_side") == side and config.get("fail_index") == n:
        print("fake: cannot go on, no C compiler", file=sys.stderr)
        sys.exit(3)
    for line in config.get("stderr", {}).get(side, []):
        print(line, file=sys.stderr)
    value = config.get("value", "aa" * 32)
    if config.get("mismatch_side") == side and config.get("mismatch_index") == n:
        value = "bb" * 32
    print(f"result output {value}")
    print(f"result tokens {'cc' * 32}")
    print(f"steps {config.get('steps', 10)}")
    us = config[side][n]
    print(f"step_us {us}")
    print(f"mean_us {us * 1.5}")
    if side == "preload" and os.environ.get("APEX_PRELOAD_STATS"):
        stats = {
            "launches": 1000, "apex": 900, "fallback": 100,
            "reasons": {"device_runtime": {"launches": 100, "example": "kernel calls __assertfail"}},
            "hops_to_cuda": 7, "hops_to_apex": 8, "cpu_syncs": 0,
            "queues": 1, "attach": "direct",
            # The first preloaded run of a program has no earlier run to advise it; later ones are advised.
            "setup": {"history": "no earlier run recorded" if n == 0 else "advised: the last 1 run(s) made ..."},
        }
        path = os.environ["APEX_PRELOAD_STATS"]
        ranks = config.get("ranks", 0)
        if not ranks:
            Path(path.replace("%p", str(os.getpid()))).write_text(json.dumps(stats))
        else:
            # A launcher that made no launch, and one summary per rank, as torchrun's processes write them.
            Path(path.replace("%p", "1")).write_text(json.dumps({"launches": 0, "apex": 0, "fallback": 0}))
            for r in range(ranks):
                Path(path.replace("%p", str(100 + r))).write_text(json.dumps(stats))
    '''
)


@unittest.skipUnless(LIBC and hasattr(os, "sched_getaffinity"), "needs a libc to preload and sched_getaffinity")
class EndToEnd(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="apex-pairs-test-")
        self.dir = Path(self.tmp.name)
        self.core = min(os.sched_getaffinity(0))

    def tearDown(self):
        self.tmp.cleanup()

    def fake(self, name, config):
        path = self.dir / f"{name}.py"
        path.write_text(FAKE)
        path.with_suffix(".json").write_text(json.dumps(config))
        return path

    def log(self, path):
        return [json.loads(line) for line in path.with_suffix(".log").read_text().splitlines()]

    def run_pairs(self, programs, n_pairs, *options, passthrough=()):
        out = self.dir / "out.json"
        cmd = [
            sys.executable, str(PAIRS), "--lib", LIBC, "--pairs", str(n_pairs), "--core", str(self.core),
            "--out", str(out), "--timeout", "60", *options, *map(str, programs),
        ]
        if passthrough:
            cmd += ["--", *passthrough]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        data = json.loads(out.read_text()) if out.exists() else None
        return proc, data

    def test_ratios_order_pinning_and_table(self):
        prog = self.fake("fake", {"plain": [100, 200, 300], "preload": [50, 100, 600]})
        proc, data = self.run_pairs([prog], 3, "--extra-env", "FAKE_EXTRA=yes", passthrough=("--steps", "7"))
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)

        log = self.log(prog)
        self.assertEqual(
            [e["side"] for e in log], ["plain", "preload", "preload", "plain", "plain", "preload"],
            "the order alternates inside the pairs",
        )
        for e in log:
            self.assertEqual(e["affinity"], [self.core])
            self.assertEqual(e["unbuffered"], "1")
            self.assertEqual(e["extra"], "yes")
            self.assertEqual(e["argv"], ["--steps", "7"])
            if e["side"] == "plain":
                self.assertIsNone(e["ld_preload"])
                self.assertIsNone(e["stats"])
            else:
                self.assertEqual(os.path.realpath(e["ld_preload"]), os.path.realpath(LIBC))
                self.assertTrue(e["stats"])

        s = data["programs"]["fake"]["summary"]
        self.assertEqual(s["ratios"], [2.0, 2.0, 0.5])
        self.assertEqual(s["ratio_median"], 2.0)
        self.assertEqual((s["ratio_min"], s["ratio_max"]), (0.5, 2.0))
        self.assertEqual(s["plain_median_us"], 200)
        self.assertEqual(s["preload_median_us"], 100)
        self.assertTrue(s["identical"])
        self.assertEqual(s["compared_runs"], 5)
        self.assertEqual(s["failures"], [])
        self.assertEqual(s["stats"]["runs"], 3)
        self.assertEqual(len(data["programs"]["fake"]["runs"]), 6)

        self.assertIn("| program | pairs | plain µs/step (median) | preload µs/step (median) |", proc.stdout)
        self.assertIn("| fake | 3 | 200.0 | 100.0 | 2.000 | 0.500-2.000 | 900/1000 (90.0%) | yes (6 runs) |",
                      proc.stdout)
        self.assertIn("2.000 2.000 0.500", proc.stdout)
        self.assertIn("fallback device_runtime: 100 e.g. 'kernel calls __assertfail'", proc.stdout)
        self.assertIn("hops_to_cuda 7, hops_to_apex 8, cpu_syncs 0", proc.stdout)
        self.assertIn("queues 1, attach direct", proc.stdout)
        self.assertEqual(s["advised_runs"], 2)
        self.assertIn("earlier runs' advice (APEX_PRELOAD_HISTORY): 2 of 3 preloaded runs taken over at their first "
                      "launch", proc.stdout)

    def test_processes_of_a_run_each_write_a_summary(self):
        prog = self.fake("ranks", {"plain": [100] * 5, "preload": [50] * 5, "ranks": 2})
        proc, data = self.run_pairs([prog], 1, "--core", f"{self.core},{self.core}")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        runs = [r for r in data["programs"]["ranks"]["runs"] if r["side"] == "preload"]
        stats = runs[0]["stats"]
        self.assertEqual((stats["launches"], stats["apex"]), (2000, 1800))
        self.assertEqual(len(stats["processes"]), 2, "the launcher without launches is left out")
        self.assertEqual(stats["reasons"]["device_runtime"]["launches"], 200)

    def test_mean_us_metric(self):
        prog = self.fake("fake", {"plain": [100, 200], "preload": [50, 400]})
        proc, data = self.run_pairs([prog], 2, "--metric", "mean_us")
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        s = data["programs"]["fake"]["summary"]
        self.assertEqual(s["ratios"], [2.0, 0.5])
        self.assertEqual(s["plain_median_us"], 225.0)

    def test_mismatch_exits_1(self):
        prog = self.fake(
            "fake", {"plain": [100, 100, 100], "preload": [90, 90, 90], "mismatch_side": "preload", "mismatch_index": 1}
        )
        proc, data = self.run_pairs([prog], 3)
        self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
        self.assertIn("OUTPUT MISMATCH", proc.stdout)
        self.assertIn("**NO**", proc.stdout)
        s = data["programs"]["fake"]["summary"]
        self.assertFalse(s["identical"])
        self.assertEqual(len(s["mismatches"]), 1)
        self.assertEqual((s["mismatches"][0]["pair"], s["mismatches"][0]["side"]), (1, "preload"))
        self.assertIn("output", s["mismatches"][0]["differences"][0])
        self.assertEqual(s["ratios"], [100 / 90] * 3, "timings are still reported")
        self.assertFalse(data["ok"])

    def test_failure_is_reported_and_others_still_run(self):
        bad = self.fake("bad", {"plain": [100, 100], "preload": [100, 100], "fail_side": "preload", "fail_index": 0})
        good = self.fake("good", {"plain": [100, 100], "preload": [100, 100]})
        proc, data = self.run_pairs([bad, good], 2)
        self.assertEqual(proc.returncode, 1, proc.stdout + proc.stderr)
        self.assertIn("FAILED: pair 0 preload: exit status 3", proc.stdout)
        self.assertIn("no C compiler", proc.stdout, "the failing run's stderr tail is shown")
        sb = data["programs"]["bad"]["summary"]
        self.assertEqual(sb["pairs_complete"], 1)
        self.assertEqual(sb["ratios"], [1.0])
        sg = data["programs"]["good"]["summary"]
        self.assertEqual(sg["pairs_complete"], 2)
        self.assertTrue(sg["identical"])
        self.assertIn("| bad | 1/2 (1 runs failed) |", proc.stdout)

    def test_panic_and_preload_lines_are_shown(self):
        prog = self.fake(
            "fake",
            {
                "plain": [100],
                "preload": [100],
                "stderr": {
                    "preload": [
                        "something harmless",
                        "thread '<unnamed>' panicked at preload/src/engine.rs:12:5:",
                        "2026-01-01T00:00:00Z  WARN apex_preload::engine: apex-preload leaves every launch to libcuda",
                    ]
                },
            },
        )
        proc, data = self.run_pairs([prog], 1)
        self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
        self.assertIn("| thread '<unnamed>' panicked at preload/src/engine.rs:12:5:", proc.stdout)
        self.assertIn("apex-preload leaves every launch to libcuda", proc.stdout)
        self.assertNotIn("something harmless", proc.stdout)

    def test_missing_program_and_bad_core(self):
        proc = subprocess.run(
            [sys.executable, str(PAIRS), "--lib", LIBC, "no-such-program"], capture_output=True, text=True
        )
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("no program", proc.stderr)
        prog = self.fake("fake", {"plain": [1], "preload": [1]})
        proc = subprocess.run(
            [sys.executable, str(PAIRS), "--lib", LIBC, "--core", "100000", str(prog)], capture_output=True, text=True
        )
        self.assertNotEqual(proc.returncode, 0)
        self.assertIn("core 100000", proc.stderr)


class Functions(unittest.TestCase):
    def test_parse_cores(self):
        self.assertEqual(pairs.parse_cores("3"), {3})
        self.assertEqual(pairs.parse_cores("3,5"), {3, 5})
        self.assertEqual(pairs.parse_cores("2-4,7"), {2, 3, 4, 7})
        with self.assertRaises(ValueError):
            pairs.parse_cores("x")

    def test_merge_process_stats(self):
        a = {"launches": 10, "apex": 9, "fallback": 1, "attach": "direct",
             "reasons": {"launch_attribute": {"launches": 1, "example": "launch attribute 10"}}}
        b = {"launches": 20, "apex": 20, "fallback": 0, "attach": "direct", "reasons": {}}
        launcher = {"launches": 0, "apex": 0, "fallback": 0, "attach": "not attempted"}
        self.assertIs(pairs.merge_process_stats([a]), a)
        self.assertIs(pairs.merge_process_stats([launcher, a]), a)
        m = pairs.merge_process_stats([launcher, a, b])
        self.assertEqual((m["launches"], m["apex"], m["fallback"]), (30, 29, 1))
        self.assertEqual(m["attach"], "direct")
        self.assertEqual(m["reasons"]["launch_attribute"], {"launches": 1, "example": "launch attribute 10"})
        self.assertEqual([p["apex"] for p in m["processes"]], [9, 20])
        self.assertEqual(pairs.merge_process_stats([launcher]), launcher)
        self.assertIsNone(pairs.merge_process_stats([]))

    def test_parse_output(self):
        p = pairs.parse_output("result a 01\nresult b 02\nsteps 5\nstep_us 12.5\nmean_us 13\nnoise here\n\n")
        self.assertEqual(p["results"], {"a": "01", "b": "02"})
        self.assertEqual((p["steps"], p["step_us"], p["mean_us"]), (5, 12.5, 13.0))
        self.assertEqual(p["extra"], ["noise here"])
        p = pairs.parse_output("result a 01\nresult a 02\nstep_us nan-ish\n")
        self.assertEqual(p["duplicates"], ["a"])
        self.assertIsNone(p["step_us"])
        self.assertEqual(p["extra"], ["step_us nan-ish"])

    def test_compare_results(self):
        ref = {"a": "1", "b": "2"}
        self.assertEqual(pairs.compare_results(ref, {"a": "1", "b": "2"}), [])
        d = pairs.compare_results(ref, {"a": "1", "b": "3", "c": "4"})
        self.assertEqual(len(d), 2)
        self.assertTrue(d[0].startswith("b:"))
        self.assertTrue(d[1].startswith("c:"))
        self.assertTrue(pairs.compare_results(ref, {"a": "1"})[0].startswith("b: missing"))

    def test_order_ratio_median(self):
        self.assertEqual(pairs.pair_order(0), ("plain", "preload"))
        self.assertEqual(pairs.pair_order(1), ("preload", "plain"))
        self.assertEqual(pairs.pair_order(4), ("plain", "preload"))
        self.assertEqual(pairs.ratio(150.0, 100.0), 1.5)
        self.assertIsNone(pairs.ratio(None, 100.0))
        self.assertIsNone(pairs.ratio(100.0, 0.0))
        self.assertEqual(pairs.median_range([3, 1, 2, 10]), (2.5, 1, 10))
        self.assertEqual(pairs.median_range([]), (None, None, None))

    def test_summary_and_table(self):
        def run(pair, side, us, results=None, error=None, stats=None):
            return {
                "pair": pair, "side": side, "step_us": us, "mean_us": us, "error": error,
                "results": results or {"x": "1"}, "stats": stats, "notable": [],
            }

        stats = {"launches": 10, "apex": 5, "fallback": 5, "reasons": {}, "extra_key": {"nested": 1}}
        runs = [
            run(0, "plain", 100), run(0, "preload", 80, stats=stats),
            run(1, "preload", 120, stats=dict(stats, launches=12, apex=6)), run(1, "plain", 90),
            run(2, "plain", 110), run(2, "preload", None, error="exit status 1", results={}),
        ]
        s = pairs.summarize_program("p", runs, 3)
        self.assertEqual(s["ratios"], [1.25, 0.75])
        self.assertEqual(s["ratio_median"], 1.0)
        self.assertEqual(s["pairs_complete"], 2)
        self.assertEqual(len(s["failures"]), 1)
        self.assertTrue(s["identical"])
        self.assertEqual(s["plain_median_us"], 100)
        self.assertEqual(s["preload_median_us"], 100)
        self.assertEqual(pairs.through_apex(s["stats"]), (5.5, 11, 50.0))
        table = pairs.markdown_table([s])
        self.assertEqual(len(table.splitlines()), 3)
        self.assertIn("| p | 2/3 (1 runs failed) | 100.0 | 100.0 | 1.000 | 0.750-1.250 | 5.50/11 (50.0%) |", table)
        report = pairs.format_program_report(s)
        self.assertIn("launches 11 (10-12)", report)
        self.assertIn('extra_key {"nested": 1}', report)

    def test_no_plain_reference(self):
        runs = [
            {"pair": 0, "side": "plain", "step_us": None, "error": "exit status 1", "results": {}, "stats": None},
            {"pair": 0, "side": "preload", "step_us": 5.0, "error": None, "results": {"x": "1"}, "stats": None},
        ]
        s = pairs.summarize_program("p", runs, 1)
        self.assertIsNone(s["identical"])
        self.assertIn("n/a", pairs.markdown_table([s]))

    def test_build_run_sides(self):
        base = {"LD_PRELOAD": "/old.so", "APEX_PRELOAD_STATS": "/old.json", "KEEP": "1"}
        cmd, env, pre, pv = pairs.build_run(
            "py", "prog.py", ["--x"], "plain", "/lib.so", "/s.json", 3, "/usr/bin/taskset", "/usr/bin/env", base,
            {"E": "1"}, {"P": "2"},
        )
        self.assertEqual(cmd, ["/usr/bin/taskset", "-c", "3", "py", "prog.py", "--x"])
        self.assertNotIn("LD_PRELOAD", env)
        self.assertNotIn("APEX_PRELOAD_STATS", env)
        self.assertNotIn("P", env)
        self.assertEqual((env["KEEP"], env["E"], env["PYTHONUNBUFFERED"]), ("1", "1", "1"))
        self.assertIsNone(pre)
        self.assertEqual(pv, {})
        cmd, env, pre, pv = pairs.build_run(
            "py", "prog.py", [], "preload", "/lib.so", "/s.json", 3, "/usr/bin/taskset", "/usr/bin/env", base,
            {}, {"P": "2"},
        )
        self.assertEqual(
            cmd,
            ["/usr/bin/taskset", "-c", "3", "/usr/bin/env", "P=2", "LD_PRELOAD=/lib.so",
             "APEX_PRELOAD_STATS=/s.json", "py", "prog.py"],
        )
        self.assertNotIn("LD_PRELOAD", env, "taskset itself is not preloaded")
        cmd, env, pre, pv = pairs.build_run(
            "py", "prog.py", [], "preload", "/lib.so", "/s.json", 3, None, "/usr/bin/env", base, {}, {},
        )
        self.assertEqual(cmd, ["py", "prog.py"])
        self.assertEqual((env["LD_PRELOAD"], env["APEX_PRELOAD_STATS"]), ("/lib.so", "/s.json"))
        self.assertIsNotNone(pre, "without taskset the child pins itself")

    def test_notable_stderr(self):
        lines, total = pairs.notable_stderr("a\nthread 'main' panicked at x\nb\nWARN apex_preload: y\n" * 2)
        self.assertEqual(lines, ["thread 'main' panicked at x", "WARN apex_preload: y"])
        self.assertEqual(total, 4)


if __name__ == "__main__":
    unittest.main()
