"""The built-in tools and environments (train.agent.tools / environment by name), and the reward
that counts a successful call.

`codebook` is the synthetic tool task's environment (`grpo demo --task tools`): each episode's row
holds a code of three random digits that nothing in the prompt determines, so only its tool
`code()` can tell it; the model learns to call it (`#`, in the plain format) and to answer with
what it returned.
"""

from __future__ import annotations

import ast
import operator
from typing import Any


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: Numbers with + - * / // % ** and parentheses, e.g. "(48 + 24) / 2".
    """
    ops = {
        ast.Add: operator.add,
        ast.Sub: operator.sub,
        ast.Mult: operator.mul,
        ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv,
        ast.Mod: operator.mod,
        ast.Pow: operator.pow,
        ast.USub: operator.neg,
        ast.UAdd: operator.pos,
    }

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return ops[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in ops:
            return ops[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    value = ev(ast.parse(expression, mode="eval"))
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


class Codebook:
    """The synthetic tool task's environment: a vault holding one code per episode."""

    def __init__(self) -> None:
        self._code = ""

    def reset(self, answer: str = "", **row: Any) -> None:
        """A new episode: the row's code is locked in the vault; the prompt stays the row's."""
        self._code = str(answer)

    def code(self) -> str:
        """Read the code locked in the vault for this episode."""
        return self._code


BUILTIN_TOOLS = {"calculator": calculator}
BUILTIN_ENVIRONMENTS = {"codebook": Codebook}


def tool_called(prompts, completions, tool_calls, **_) -> list[float]:
    """1.0 where the episode called a tool and the call returned without an error, else 0.0 (a
    shaping reward for learning to call: give it a small weight beside the task's)."""
    return [float(any(not c["error"] for c in calls)) for calls in tool_calls]
