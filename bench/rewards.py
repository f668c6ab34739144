"""Benchmark: math_answer scoring speed by kind of answer, in rows per second.

    python -m bench.rewards [--rows 2000]

GSM8K-like references (integers) against completions whose final answers are plain numbers,
numbers with a unit ('18 dollars', '\\boxed{18 \\text{ dollars}}'), and LaTeX that needs
math-verify ('\\sqrt{324}'). Each answer is distinct, so math-verify's parse cache never hits.
The baseline, measured in the same run, is math-verify's parse/verify on the unit answers: the
path they took before the single-number check came first.
"""

from __future__ import annotations

import argparse
import time

from grpo_core.rewards import math_answer as mr


def rows_per_s(pairs: list[tuple[str, str]], fn) -> tuple[float, float]:
    t = time.perf_counter()
    right = sum(bool(fn(a, g)) for a, g in pairs)
    return len(pairs) / (time.perf_counter() - t), right / len(pairs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rewards")
    ap.add_argument("--rows", type=int, default=2000)
    n = ap.parse_args(argv).rows
    few = max(20, n // 20)  # math-verify is ~1000x slower: fewer rows keep the run short
    kinds = {
        "plain number": ([(f"{i}", f"{i}") for i in range(n)], mr.is_correct),
        "number + unit": ([(f"{i} dollars", f"{i}") for i in range(n)], mr.is_correct),
        "boxed + \\text unit": (
            [(mr.extract_answer(f"so \\boxed{{{i} \\text{{ dollars}}}}"), f"{i}") for i in range(n)],
            mr.is_correct,
        ),
        "LaTeX (math-verify)": ([(f"\\sqrt{{{i * i}}}", f"{i}") for i in range(1, few + 1)], mr.is_correct),
        "baseline: unit via math-verify": (
            [(f"{i} dollars", f"{i}") for i in range(n, n + few)],
            lambda a, g: mr._verify(g, mr._clean(a)) or mr._close(mr._lone_number(mr._clean(a)), mr._number(g)),
        ),
    }
    mr.is_correct("1", "1")
    mr._verify("1", "1")  # imports math-verify and sympy before timing
    rows = {name: rows_per_s(pairs, fn) for name, (pairs, fn) in kinds.items()}
    base = rows["baseline: unit via math-verify"][0]
    print(f"{'answers':32} {'rows/s':>10} {'x baseline':>11} {'correct':>8}")
    for name, (rate, right) in rows.items():
        print(f"{name:32} {rate:10.0f} {rate / base:11.1f} {right:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
