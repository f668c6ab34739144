"""The built-in math rewards: answer extraction, comparison with and without math-verify, the
format rewards, worker threads (math-verify's own timeouts only work in the main thread) and
inputs that would make sympy run for ever."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from grpo_core.config.run import RewardSpec
from grpo_core.rewards import math_answer as mr
from grpo_core.rewards.math_answer import extract_answer, integer_answer, is_correct, math_answer, think_format
from grpo_core.rewards.registry import builtin_rewards, make_rewards


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("<think>7 * 6</think><answer>42</answer>", "42"),
        ("<answer>1</answer> then <answer>The result is \\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),
        ("so it is \\boxed{\\frac{3}{4}} and \\boxed{x^{2}}.", "x^{2}"),
        ("\\boxed 7.", "7"),
        ("\\fbox{12}", "12"),
        ("He has 5 + 6 = 11 apples.\n#### 11\nDone", "11"),
        ("first 3, then 12, finally 1,200 apples.", "1,200"),
        ("half is -0.5", "-0.5"),
        ("\\boxed{\\frac{1}{2", None),  # cut off mid-answer: no answer (not the 2 inside)
        ("no digits here", None),
        ([{"role": "assistant", "content": "<answer>9</answer>"}], "9"),  # chat-style completion
    ],
)
def test_extract_answer(completion, answer):
    assert extract_answer(completion) == answer


CASES = [  # (answer, ground truth, correct)
    ("42", "42", True),
    ("42.0", "42", True),
    ("1,200", "1200", True),
    ("-3", "3", False),
    ("1000001", "1000000", False),
    ("1000000.0000001", "1000000", False),  # an integer reference exactly: no tolerance
    ("114200.1", "114200", False),  # accepted by a relative 1e-6 before (GSM8K: 18 of 1319 rows at N + 0.1)
    ("114200.001", "114200", False),  # (131 of 1319 at N + 0.001)
    ("114200.000", "114200", True),
    ("0.3333333", "0.333333", True),  # a non-integer reference: within a relative 1e-6
    ("18 \\text{ dollars}", "18", True),
    ("€18", "18", True),
    ("19 dollars", "18", False),
    ("0.333333", "\\frac{1}{3}", True),
    ("3/4", "0.75", True),
    ("\\dfrac{3}{4}", "0.75", True),
    ("$18.00", "18", True),
    ("\\$18", "18", True),
    ("10\\%", "10", True),
    ("72 clips", "72", True),
    ("x = 3", "3", True),
    ("2 or 3", "3", False),
    ("3 \\cdot 2", "3", False),
    ("\\sqrt{2}", "2", False),
    ("41", "42", False),
    ("", "42", False),
    (None, "42", False),
    ("7", ["6", "7"], True),
    ("A", "A", True),
    ("\\text{(B)}", "(B)", True),
]
SYMBOLIC = [  # what needs math-verify
    ("\\frac{\\sqrt{3}}{2}", "\\frac{3}{2\\sqrt{3}}", True),
    ("x^2+1", "1+x^2", True),
    ("2^{10}", "1024", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("5!", "120", True),
    ("\\pi", "3.14", False),
    ("x^2+2", "1+x^2", False),
]


@pytest.mark.parametrize("answer, truth, correct", CASES + SYMBOLIC)
def test_is_correct_with_math_verify(answer, truth, correct):
    assert mr.USE_MATH_VERIFY  # a project dependency
    assert is_correct(answer, truth) is correct


@pytest.mark.parametrize("answer, truth, correct", CASES + [(a, t, False) for a, t, ok in SYMBOLIC if ok])
def test_numeric_fallback_without_math_verify(monkeypatch, answer, truth, correct):
    monkeypatch.setattr(mr, "USE_MATH_VERIFY", False)
    assert is_correct(answer, truth) is correct


def test_math_answer_scores_and_skips_rows_without_ground_truth():
    completions = ["<answer>42</answer>", "\\boxed{41}", "#### 7", "no answer at all", "<answer>3</answer>"]
    truths = ["42", "42", None, "7", ""]
    assert math_answer([""] * 5, completions, ground_truth=truths) == [1.0, 0.0, None, 0.0, None]
    assert math_answer(["p"], ["42"]) == [None]  # a dataset without the column: not applicable
    assert math_answer(["p"], ["42"], ground_truth=["42"], answer=["x #### 42"]) == [1.0]  # other columns ignored


def test_think_format():
    prompts = ["q"] * 7 + ["<|im_start|>assistant\n<think>\n"]
    completions = [
        "<think>a</think><answer>1</answer>",  # exact
        "\n<think>\nlong\n</think>\n\n<answer> 1 </answer>\n",  # whitespace around is fine
        "<answer>1</answer><think>a</think>",  # wrong order: each tag once, 4 x 0.125
        "<think>a</think><answer>1</answer> and more",  # text after: 0.5
        "<think>a</think>",  # 2 tags
        "<think>a<think>b</think><answer>1</answer>",  # <think> twice: 3 tags once
        "just 1",
        "reasoning</think><answer>1</answer>",  # the prompt opened the block
    ]
    assert think_format(prompts, completions) == [1.0, 1.0, 0.5, 0.5, 0.25, 0.375, 0.0, 1.0]


def test_integer_answer():
    completions = [
        "<answer>42</answer>",
        "#### 1,200",
        "\\boxed{-7}",
        "\\boxed{2.5}",
        "\\boxed{\\frac{1}{2}}",
        "<answer>x</answer>",
        "nothing",
    ]
    assert integer_answer([""] * 7, completions) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_math_verify_runs_in_worker_threads():
    """math-verify's default timeouts use SIGALRM and refuse to run off the main thread; ours
    are off, so rewards scored in a thread pool (as the trainer may) work and agree with the
    main thread."""
    import math_verify

    errors = []
    t = threading.Thread(target=lambda: errors.append(_raises(lambda: math_verify.parse("$\\frac{1}{2}$"))))
    t.start()
    t.join()
    assert errors == [True]  # why the timeouts are off: the default fails in a thread
    pairs = [(f"<answer>{a}</answer>", t) for a, t, _ in SYMBOLIC] * 4
    want = [float(ok) for _, _, ok in SYMBOLIC] * 4
    mr._parse.cache_clear()
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda ct: math_answer(["p"], [ct[0]], ground_truth=[ct[1]])[0], pairs))
    assert got == want


def _raises(fn) -> bool:
    try:
        fn()
        return False
    except ValueError:
        return True


def test_explosive_answers_are_wrong_quickly_in_a_thread():
    """Answers sympy could spend for ever on are scored 0 without evaluating them; a hang here
    would otherwise hang training, so the check runs in a daemon thread with a deadline."""
    completions = [
        "\\boxed{9^{9^{9^{9}}}}",
        "\\boxed{(10^{9999})^{10000}}",
        "\\boxed{999999999!}",
        "\\boxed{(x+1)^{100000}}",
        "\\boxed{" + "1+" * 500 + "1}",
        "\\boxed{\\binom{10^{9}}{5 \\cdot 10^{8}}}",
    ]
    out = []
    t = threading.Thread(
        target=lambda: out.append(math_answer([""] * 6, completions, ground_truth=["5"] * 6)), daemon=True
    )
    start = time.perf_counter()
    t.start()
    t.join(timeout=30)
    assert not t.is_alive(), "math_answer hung on an explosive answer"
    assert out == [[0.0] * 6] and time.perf_counter() - start < 10


def test_built_in_by_name_in_a_config():
    assert {"math_answer", "think_format", "integer_answer"} <= set(builtin_rewards())
    rewards = make_rewards(
        (
            RewardSpec(function="math_answer"),
            RewardSpec(function="think_format", weight=0.1),
            RewardSpec(function="integer_answer", weight=0),
        )
    )
    assert [(r.name, r.weight) for r in rewards] == [("math_answer", 1.0), ("think_format", 0.1), ("integer_answer", 0)]


def test_answers_with_a_unit_never_reach_math_verify():
    """'18 dollars' is a number with a word: scored by the single-number check (microseconds),
    not math-verify's parser (15-57 ms a row before)."""
    answers = [f"{n} dollars" for n in range(1000, 1040)] + [f"\\text{{{n} apples}}" for n in range(1000, 1040)]
    before = mr._parse.cache_info().misses
    assert [is_correct(a, a.split()[0].lstrip("\\text{")) for a in answers] == [True] * len(answers)
    assert mr._parse.cache_info().misses == before
