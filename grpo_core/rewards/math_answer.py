"""Built-in rewards for math data (GSM8K, MATH, verl parquet): they read the `ground_truth`
column that grpo_core.data.formats writes.

    math_answer     1.0 when the completion's final answer equals ground_truth, else 0.0; None
                    (row not scored by it) where a row has no ground_truth
    think_format    1.0 for '<think>...</think>' then '<answer>...</answer>' and nothing else;
                    partial credit 0.125 per tag that appears exactly once otherwise (at most 0.5)
    integer_answer  1.0 when the final answer is an integer (GSM8K answers all are)

The final answer is the last <answer>...</answer> block (the \\boxed{} inside it if any), else
the last \\boxed{}, else the text after the last '####', else the last number of the completion.
Answers are compared as numbers first (exact fractions; an integer reference exactly, any other
within a relative 1e-6), then as the one number of an answer with a unit or a name ('18 dollars',
'x = 3'), then with math-verify's parse/verify (LaTeX, fractions, radicals, sets, equations) when
it is installed: a number is checked in microseconds, math-verify takes milliseconds.

math-verify bounds its own time with SIGALRM, which only works in the main thread; rewards run
in worker threads, so its timeouts are off here and the time is bounded before it: answers
longer than MAX_ANSWER_CHARS are wrong without parsing, and an expression whose evaluation could
explode (a power tower such as 9^{9^{9^9}}, the factorial of a large number) is never handed to
sympy's comparison.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
import re
from fractions import Fraction
from typing import Any, Sequence

from grpo_core.rewards.functions import completion_text

MAX_ANSWER_CHARS = 200  # longer final answers are scored 0 without parsing
_MAX_DIGITS = 10_000  # largest number (in digits) or factorial argument sympy may evaluate
_MAX_SYMBOLIC_POWER = 1_000  # (x + 1)^n expands into n + 1 terms
_REL_TOL = 1e-6

# Optional: without it answers are compared as numbers or as normalised text. Imported on first
# use (with sympy it takes ~0.5 s), so configs without math rewards do not pay for it.
USE_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None


class _DropTimeoutNotice(logging.Filter):
    """math-verify warns once that its timeout is off; here that is deliberate (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotice())


# -- extracting the final answer -----------------------------------------------------------

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _last_boxed(text: str) -> tuple[bool, str | None]:
    """(found, content) of the last \\boxed{...} or \\fbox{...} (balanced braces), or of
    '\\boxed 5'; content None when it is cut off (unbalanced) or empty."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return False, None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5) :]
    if not rest.startswith("{"):
        m = re.match(r"\s+([^\s$]+)", rest)
        return True, (m.group(1).rstrip(".,;") or None) if m else None
    depth = 0
    for j, ch in enumerate(rest):
        depth += (ch == "{") - (ch == "}")
        if depth == 0:
            return True, rest[1:j].strip() or None
    return True, None


def extract_answer(completion: Any) -> str | None:
    """The completion's final answer as text (see the module docstring for the order), or None.
    A \\boxed{} cut off by the length limit is no answer: the number before it is not one."""
    text = completion_text(completion)
    tags = _ANSWER_TAG.findall(text)
    if tags:
        found, boxed = _last_boxed(tags[-1])
        return boxed if found else (tags[-1].strip() or None)
    found, boxed = _last_boxed(text)
    if found:
        return boxed
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


# -- comparing -----------------------------------------------------------------------------


def _clean(s: str) -> str:
    """Strip what does not change the value: math delimiters, \\$ and \\%, thin spaces,
    \\text{} around units, \\left/\\right, a trailing full stop, thousands separators."""
    s = s.strip()
    s = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", s)
    for junk in (
        "€",
        "£",
        "¥",
        "₹",
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\ ",
        "\\$",
        "\\%",
        "%",
        "$",
        "\\(",
        "\\)",
        "\\[",
        "\\]",
    ):
        s = s.replace(junk, " " if junk == "\\ " else "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").strip().rstrip(".").strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _number(s: str) -> Fraction | None:
    """'42', '-0.5', '3/4', '\\frac{3}{4}', '1e3' as an exact Fraction, else None."""
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(-?\d+)\}|\\frac(\d)(\d)", s)
    try:
        if m:
            num, den = (m.group(1), m.group(2)) if m.group(1) is not None else (m.group(3), m.group(4))
            return Fraction(int(num), int(den))
        if re.fullmatch(r"-?\d+(\.\d+)?(/\d+)?|-?\.\d+|-?\d+(\.\d+)?e-?\d{1,3}", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def _close(a: Fraction, b: Fraction) -> bool:
    """`a` (the answer) against `b` (the reference): an integer reference exactly (1000001 is not
    1000000, and neither is 114200.1 114200); otherwise within a relative 1e-6, so that 0.333333
    is 1/3."""
    if b.denominator == 1:
        return a == b
    return abs(a - b) <= _REL_TOL * max(1, abs(b))


_NOT_A_UNIT = re.compile(r"\\|\^|/|\b(?:sqrt|log|ln|sin|cos|tan|exp|pi)\b")


def _lone_number(s: str) -> Fraction | None:
    """'72 clips', 'x = 3': the one number of an answer whose other words are a unit or a name;
    None when it has two numbers or any operator ('2 or 3', '\\sqrt{2}', '2^3')."""
    numbers = _NUMBER.findall(s)
    if len(numbers) != 1 or _NOT_A_UNIT.search(s):
        return None
    rest = s.replace(numbers[0], " ", 1)
    if not re.fullmatch(r"\s*(?:[A-Za-z]\w*\s*=\s*)?[A-Za-z\s]*", rest):
        return None
    return _number(numbers[0].replace(",", ""))


def is_correct(answer: str | None, ground_truth: Any) -> bool:
    """Whether an extracted answer matches the reference (a string, number or a list of
    acceptable ones)."""
    if isinstance(ground_truth, (list, tuple)):
        return any(is_correct(answer, g) for g in ground_truth)
    if answer is None or ground_truth is None:
        return False
    a, g = _clean(answer), _clean(str(ground_truth))
    if not a or not g or len(a) > MAX_ANSWER_CHARS:
        return False
    na, ng = _number(a), _number(g)
    if na is not None and ng is not None:
        return _close(na, ng)
    if a == g:
        return True
    if ng is not None:  # '18 dollars', 'x = 3': the one number of a unit or a name, before math-verify
        lone = _lone_number(a)
        if lone is not None:
            return _close(lone, ng)
    return USE_MATH_VERIFY and len(g) <= 4 * MAX_ANSWER_CHARS and _verify(g, a)


@functools.lru_cache(maxsize=4096)
def _parse(s: str) -> tuple:
    """math-verify's parse of one answer, timeouts off (this runs in worker threads)."""
    import math_verify  # heavy (sympy, latex2sympy): only a run with the math rewards loads it

    return tuple(math_verify.parse(f"${s}$", parsing_timeout=None))


def _verify(gold: str, answer: str) -> bool:
    g, a = _parse(gold), _parse(answer)
    if not g or not a or not (_tame(g) and _tame(a)):
        return False
    import math_verify  # heavy, as in _parse

    return bool(math_verify.verify(list(g), list(a), timeout_seconds=None))


def _tame(parsed: Sequence[Any]) -> bool:
    """False when comparing could make sympy build something astronomically large: a number
    power with more than _MAX_DIGITS digits, a symbolic power above _MAX_SYMBOLIC_POWER, or a
    factorial/binomial/gamma of more than _MAX_DIGITS. Nodes are checked innermost first, so
    evaluating an exponent to check it is itself cheap."""
    import sympy  # heavy, as math_verify

    combinatorial = (
        sympy.factorial,
        sympy.factorial2,
        sympy.subfactorial,
        sympy.binomial,
        sympy.gamma,
        sympy.RisingFactorial,
        sympy.FallingFactorial,
    )
    for item in parsed:
        if not isinstance(item, sympy.Basic):
            continue
        for node in sympy.postorder_traversal(item):
            if isinstance(node, sympy.Pow) and not node.exp.free_symbols:
                e = _magnitude(node.exp)
                if node.base.free_symbols:
                    if not e <= _MAX_SYMBOLIC_POWER:
                        return False
                    continue
                b = _magnitude(node.base)
                if not (b in (0.0, 1.0) or e * abs(math.log10(b)) <= _MAX_DIGITS):  # also catches inf/nan
                    return False
            elif isinstance(node, combinatorial):
                if any(not x.free_symbols and not _magnitude(x) <= _MAX_DIGITS for x in node.args):
                    return False
    return True


def _magnitude(x) -> float:
    try:
        return abs(complex(x.evalf(15)))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return float("inf")


# -- the reward functions ------------------------------------------------------------------


def _missing(g: Any) -> bool:
    return g is None or (isinstance(g, str) and not g.strip()) or (isinstance(g, (list, tuple)) and not g)


def math_answer(
    prompts: Sequence[Any], completions: Sequence[Any], ground_truth: Sequence[Any] | None = None, **_
) -> list[float | None]:
    """1.0 when the final answer equals ground_truth, 0.0 when not, None where a row has none."""
    if ground_truth is None:
        return [None] * len(completions)
    return [None if _missing(g) else float(is_correct(extract_answer(c), g)) for c, g in zip(completions, ground_truth)]


_THINK_ANSWER = re.compile(r"\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def think_format(prompts: Sequence[Any], completions: Sequence[Any], **_) -> list[float]:
    """1.0 for exactly '<think>...</think><answer>...</answer>' (whitespace around allowed), else
    0.125 for each of the four tags that appears exactly once. A prompt that ends in '<think>'
    (chat templates of reasoning models open the block themselves) counts as the opening tag."""
    out = []
    for p, c in zip(prompts, completions):
        text = completion_text(c)
        if isinstance(p, str) and p.rstrip().endswith("<think>") and "<think>" not in text:
            text = "<think>" + text
        once = [text.count(t) == 1 for t in _TAGS]
        out.append(1.0 if all(once) and _THINK_ANSWER.fullmatch(text) else 0.125 * sum(once))
    return out


def integer_answer(prompts: Sequence[Any], completions: Sequence[Any], **_) -> list[float]:
    """1.0 when the final answer is an integer ('42', '-7', '1,200'), else 0.0."""
    out = []
    for c in completions:
        a = extract_answer(c)
        out.append(float(a is not None and re.fullmatch(r"-?\d+", _clean(a)) is not None))
    return out


BUILTIN = {"math_answer": math_answer, "think_format": think_format, "integer_answer": integer_answer}
