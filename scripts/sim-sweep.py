#!/usr/bin/env python3
"""Issue 25's targets over many traces, not four (docs/DESIGN.md §24, "Many traces").

Runs `allot-sim --json` for every seed × trace shape (1.2×, 1.6×, 2.5× load with 10 %
whole-node jobs, and 1.6× with 30 %), with Fair, Fifo and StrictPriority on each, and
prints one line per trace with Fair's figures against the targets, then how many traces
meet each target. The simulator is deterministic: the same seeds give the same table.

usage: scripts/sim-sweep.py [--seeds 1-6] [--sim PATH] [--jobs 2] [--json]
(`scripts/sim-sweep.sh` builds the simulator and calls this.)
"""

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

SHAPES = [("1.2", "10"), ("1.6", "10"), ("2.5", "10"), ("1.6", "30")]
POLICIES = "fair,fifo,strict"


def seeds(text):
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"bad seed list {text!r}: use 1-6 or 1,4,9")
        out.extend(range(int(lo), int(hi or lo) + 1))
    if not out:
        raise argparse.ArgumentTypeError("no seeds")
    return out


def run(sim, seed, load, big):
    cmd = [sim, "--json", "--policies", POLICIES, "--seed", str(seed), "--load", load,
           "--big-jobs", big]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    by_policy = {}
    for line in done.stdout.splitlines():
        row = json.loads(line)
        if "policy" in row:
            by_policy[row["policy"]] = row
    return by_policy


def tier(row, name):
    return next(t for t in row["tiers"] if t["tier"] == name)


def figures(by_policy):
    fair, fifo, strict = by_policy["Fair"], by_policy["Fifo"], by_policy["StrictPriority"]
    free, paid = tier(fair, "free"), tier(fair, "paid")
    fifo_max = tier(fifo, "free")["wait_max_s"]
    strict_shed = tier(strict, "paid")["shed"]
    f = {
        "alloc_pct": fair["allocation_pct"],
        "lost_pct": fair["gpu_hours_lost_pct"],
        "ent_p95_s": tier(fair, "enterprise w/o flood org")["wait_p95_s"],
        "jain_free": free["jain_index"],
        "jain_paid": paid["jain_index"],
        "paid_backlogged_orgs": paid["backlogged_orgs"],
        "paid_shed": paid["shed"],
        "strict_paid_shed": strict_shed,
        "free_max_s": free["wait_max_s"],
        "fifo_free_max_s": fifo_max,
    }
    f["met"] = {
        "allocation >= 98%": f["alloc_pct"] >= 98.0,
        "enterprise p95 <= 30 s": f["ent_p95_s"] <= 30,
        "Jain >= 0.95 free and paid": min(f["jain_free"], f["jain_paid"]) >= 0.95,
        "GPU-h lost <= 2%": f["lost_pct"] <= 2.0,
        "paid shed <= 1.5x strict": f["paid_shed"] <= 1.5 * strict_shed,
        "free max wait <= 2x FIFO": f["free_max_s"] <= 2 * fifo_max,
    }
    return f


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=seeds, default=seeds("1-6"))
    target = os.environ.get("CARGO_TARGET_DIR", os.path.expanduser("~/.cache/allot-target"))
    ap.add_argument("--sim", default=os.path.join(target, "release", "allot-sim"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if a.jobs < 1:
        ap.error("--jobs must be at least 1")
    if not os.access(a.sim, os.X_OK):
        ap.error(f"no simulator at {a.sim} (scripts/sim-sweep.sh builds it)")
    traces = [(s, load, big) for s in a.seeds for load, big in SHAPES]
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        results = list(pool.map(lambda t: figures(run(a.sim, *t)), traces))
    if a.json:
        print(json.dumps([{"seed": s, "load": float(l), "big_jobs_pct": int(b), **f}
                          for (s, l, b), f in zip(traces, results)]))
        return
    print(f"{'seed · load · 8-GPU %':22} {'alloc %':>7} {'lost %':>6} {'ent p95':>7} "
          f"{'Jain free/paid (orgs)':>22} {'paid shed (strict)':>18} {'free max / FIFO s':>20}")
    for (s, load, big), f in zip(traces, results):
        print(f"{f'{s} · {load}× · {big}':22} {f['alloc_pct']:7.1f} {f['lost_pct']:6.2f} "
              f"{f['ent_p95_s']:7.0f} "
              f"{f['jain_free']:.3f}/{f['jain_paid']:.3f} ({f['paid_backlogged_orgs']})"
              f" {f['paid_shed']:>8} ({f['strict_paid_shed']:>6})"
              f" {f['free_max_s']:>8.0f} / {f['fifo_free_max_s']:<8.0f}")
    print(f"\ntraces meeting each target (of {len(traces)}):")
    for name in results[0]["met"]:
        print(f"  {name:28} {sum(f['met'][name] for f in results)}")


if __name__ == "__main__":
    sys.exit(main())
