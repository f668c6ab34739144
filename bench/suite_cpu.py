"""The suite's CPU time by test module, from a run with GRPO_TEST_CPU=FILE (tests/conftest.py):

    GRPO_TEST_CPU=/tmp/cpu.tsv make test
    python -m bench.suite_cpu /tmp/cpu.tsv [--top 25]

On this 2-core machine `make test` is CPU-bound (3 test processes on 2 cores): its wall time is
about its CPU time over 2, so the modules that cost the most CPU are the ones to make cheaper.
Prints a table: each module's CPU seconds in its test process and in the processes its tests
waited for (workers, CLIs, grpo serve and the flow runs it reaped), its wall seconds, its tests.
A child's CPU is counted when it is reaped: one a test left behind counts in the test that reaps
it (subprocess reaps a dropped Popen's process at the next Popen). Then the tests after which a
process they started still ran (the session's Prefect server aside)."""

from __future__ import annotations

import argparse
import collections


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.suite_cpu", description=__doc__.split("\n")[0])
    ap.add_argument("file")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    own, kids, wall, tests = (collections.Counter() for _ in range(4))
    left: list[tuple[str, str]] = []  # (test, the processes that ran after it and not before it)
    seen: dict[str, set[str]] = {}  # per test process: what ran after its previous test
    server: dict[str, str] = {}  # per test process: its session's Prefect server (the first 'prefect')
    with open(args.file) as f:
        for line in f:
            nodeid, a, b, w, *more = line.rstrip("\n").split("\t")
            if len(more) == 2:  # the test process and what it had running after the test
                worker, running = more[0], set(filter(None, more[1].split(",")))
                if worker not in server and (first := sorted(r for r in running if r.endswith(":prefect"))):
                    server[worker] = first[0]
                new = running - seen.get(worker, set()) - {server.get(worker)}
                seen[worker] = running
                if new:
                    left.append((nodeid, ",".join(sorted(new))))
            module = nodeid.split("::", 1)[0]
            own[module] += float(a)
            kids[module] += float(b)
            wall[module] += float(w)
            tests[module] += 1
    total = {m: own[m] + kids[m] for m in own}
    print(f"{'module':48} {'CPU-s':>8} {'own':>8} {'children':>9} {'wall-s':>8} {'tests':>6}")
    for m in sorted(total, key=total.get, reverse=True)[: args.top]:
        print(f"{m:48} {total[m]:8.1f} {own[m]:8.1f} {kids[m]:9.1f} {wall[m]:8.1f} {tests[m]:6d}")
    print(
        f"{'all ' + str(len(total)) + ' modules':48} {sum(total.values()):8.1f} {sum(own.values()):8.1f}"
        f" {sum(kids.values()):9.1f} {sum(wall.values()):8.1f} {sum(tests.values()):6d}"
    )
    if left:
        print("\nstill running after a test, not before it (a module's fixture may hold one until its last test):")
        for nodeid, names in left:
            print(f"  {nodeid}: {names}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
