"""Reward functions: `f(prompts, completions, **columns) -> list[float | None]`, the signature
TRL and EasyDeL users already write. Several combine as a weighted sum; `None` means "this
function does not apply to this row" and a row no function applies to is left out of the loss.

What a function receives is what TRL passes (reward_inputs): the dataset's columns as keywords,
`completion_ids` (each completion's token ids, its closing EOS included) and `trainer_state`
(`.global_step`, `.max_steps`) to a function that names them or takes **kwargs; and for chat
data (prompts that were {role, content} messages) the prompts as those messages and each
completion as `[{"role": "assistant", "content": text}]`, so `completion[0]["content"]` works.

With a time limit (`score(..., timeout_s=...)`, train.reward_timeout_s in a worker) each call
runs in a thread of its own and is waited for at most that long: Python cannot stop a function
that never returns, so past the limit RewardTimeout is raised and the thread is abandoned (a
daemon: it never holds the process open); the worker then exits without joining it.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import threading
from typing import Any, Callable, Sequence

import numpy as np

from grpo_core.code import load_code
from grpo_core.data.formats import completion_text  # noqa: F401 - a reward helper; rewards import it from here
from grpo_core.errors import RewardFunctionError, RewardTimeout
from grpo_core.rewards.by_value import is_pickled

RewardFn = Callable[..., Sequence[float | None]]


@dataclasses.dataclass(frozen=True)
class Reward:
    fn: RewardFn
    weight: float = 1.0
    name: str = ""
    # Where a config names it (grpo_core.rewards.registry.make_rewards): the field, such as
    # "rewards[0].function", and its value, such as "path/to/my_rewards.py:slow". Messages that
    # must lead a user to the line of config to change (a time limit passed) show both.
    field: str = ""
    spec: str = ""
    # A built-in scores an episode's final answer (grpo_core.agent): the text, or for chat data the
    # last assistant message; a user's function reads the whole episode, as TRL passes it
    builtin: bool = False
    # A reward model (grpo_core.rewards.reward_model.ModelReward): the project's own code on the
    # run's devices, called in the calling thread without a time limit (its first call compiles)
    model: bool = False

    def __post_init__(self):
        if not callable(self.fn):
            raise TypeError(f"reward {self.name or self.fn!r} is not callable")
        if not self.name:
            object.__setattr__(self, "name", getattr(self.fn, "__name__", type(self.fn).__name__))

    def takes(self, keyword: str) -> bool:
        """Whether the function accepts `keyword` (by name, or through **kwargs): completion_ids
        and trainer_state go only to functions that do."""
        return _takes(self.fn, keyword)

    def describe(self) -> str:
        """How messages name it: `'slow' (rewards[0].function: my_rewards.py:slow)`, or `'slow'`."""
        where = f"{self.field}: {self.spec}" if self.field and self.spec else self.field or self.spec
        return f"{self.name!r}" + (f" ({where})" if where else "")


@dataclasses.dataclass(frozen=True)
class TrainerState:
    """What TRL's reward functions read of its trainer state: the step being scored (the
    checkpoint's step in evaluation) and the run's last."""

    global_step: int
    max_steps: int


# Keys of a prepared row that are not dataset columns: how the prompt was rendered and encoded.
PROMPT_KEYS = ("prompt", "prompt_ids", "prompt_messages")


def reward_inputs(
    rows: Sequence[dict[str, Any]],
    texts: Sequence[str],
    repeat: int = 1,
    completion_ids: Sequence[Sequence[int]] | None = None,
    state: TrainerState | None = None,
) -> tuple[list[Any], list[Any], dict[str, list[Any]]]:
    """(prompts, completions, columns) for score(), from prepared rows and `repeat` completion
    texts per row, as TRL passes them: rows whose prompt was chat messages (their
    "prompt_messages") give message lists; completion_ids and trainer_state join the columns."""
    rep = lambda xs: [x for x in xs for _ in range(repeat)]
    chat = bool(rows) and all(r.get("prompt_messages") for r in rows)  # a batch mixing text prompts: text
    prompts = rep([r["prompt_messages"] if chat else r.get("prompt", "") for r in rows])
    completions = [[{"role": "assistant", "content": t}] for t in texts] if chat else list(texts)
    columns = {k: rep([r.get(k) for r in rows]) for k in (rows[0] if rows else {}) if k not in PROMPT_KEYS}
    if completion_ids is not None:
        columns["completion_ids"] = [list(map(int, c)) for c in completion_ids]
    if state is not None:
        columns["trainer_state"] = state
    return prompts, completions, columns


def soft_overlong(
    prompts, completions, completion_ids, max_completion_len: int, soft_punish_cache: int, **_
) -> list[float]:
    """DAPO's soft overlong punishment (a built-in; rewards[].params sets its two lengths): 0 up to
    max_completion_len - soft_punish_cache tokens, then falling linearly to -1 at
    max_completion_len, and -1 beyond (L_max and L_cache in the DAPO paper, TRL's
    get_soft_overlong_punishment)."""
    start = max_completion_len - soft_punish_cache
    out = []
    for ids in completion_ids:
        n = len(ids)
        out.append(0.0 if n <= start else -1.0 if n > max_completion_len else (start - n) / soft_punish_cache)
    return out


soft_overlong.REQUIRED_PARAMS = ("max_completion_len", "soft_punish_cache")
soft_overlong.PARAMS_EXAMPLE = "params: {max_completion_len: 512, soft_punish_cache: 128}"


def _short(text: Any, n: int = 60) -> str:
    s = repr(text)
    return s if len(s) <= n else s[: n - 3] + "..."


TIMEOUT_FIELD = "train.reward_timeout_s"


def call_bounded(reward: Reward, prompts, completions, columns, timeout_s: float | None, batch: str):
    """reward.fn(prompts, completions, **columns), in a thread waited for at most `timeout_s`
    (None: called here, unbounded). RewardTimeout names the function, `batch` and the limit."""
    if timeout_s is None:
        return reward.fn(prompts, completions, **columns)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = reward.fn(prompts, completions, **columns)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread as it is
            box["exc"] = exc

    # A fresh daemon thread per call (a pool's threads are joined at interpreter exit, and one
    # stuck call would take a pool slot for good); the cost is ~0.1 ms against a batch's scoring.
    thread = threading.Thread(target=run, name=f"reward-{reward.name}", daemon=True)
    thread.start()
    thread.join(timeout_s)  # interruptible: SIGINT/SIGTERM still reach the main thread
    if thread.is_alive():
        raise RewardTimeout(
            f"reward function {reward.describe()} did not return within {timeout_s:g} s on {batch or 'a batch'} "
            f"({len(completions)} completions); the limit is {TIMEOUT_FIELD}. Fix the function (or raise the "
            "limit if it is only slow): a call that never returns cannot be stopped, so the run stops here and is "
            "not retried"
        )
    if "exc" in box:
        raise box["exc"]
    return box["out"]


class ThreadedRewardError(RewardFunctionError):
    """A reward function that cannot run outside the main thread (signal.alarm: math-verify's
    default time limits); it fails on every row, whatever the completions."""


def _needs_main_thread(exc: BaseException) -> bool:
    """Whether `exc` (or what caused it) is Python's refusal to use signals outside the main
    thread; math-verify re-raises it as its own 'doesn't support threaded environment'."""
    seen = 0
    while exc is not None and seen < 8:
        text = str(exc)
        if "signal only works in main thread" in text or "support threaded environment" in text:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _call_one(
    reward: Reward, prompts, completions, columns, timeout_s: float | None = None, batch: str = ""
) -> np.ndarray:
    n = len(completions)
    try:
        out = call_bounded(reward, prompts, completions, columns, timeout_s, batch)
    except RewardTimeout:
        raise
    except Exception as exc:  # noqa: BLE001 - a user's function: report it with the row that fails
        if reward.model:  # the project's code: its errors (a config's, a device's) are its own
            raise
        if timeout_s is not None and _needs_main_thread(exc):
            raise ThreadedRewardError(
                f"reward function {reward.describe()} raised {type(exc).__name__}: {exc}. Reward functions run in "
                f"a thread of their own (so that {TIMEOUT_FIELD} can bound them), where signal-based time limits "
                "cannot work: call math-verify with parsing_timeout=None and timeout_seconds=None, as the built-in "
                "math_answer does, and let the reward time limit bound it"
            ) from exc
        raise RewardFunctionError(_find_bad_row(reward, prompts, completions, columns, exc, timeout_s, batch)) from exc
    try:
        out = list(out)
    except TypeError:
        raise RewardFunctionError(
            f"reward function {reward.name!r} returned {type(out).__name__}, expected a list of {n} floats (or None)"
        ) from None
    if len(out) != n:
        raise RewardFunctionError(f"reward function {reward.name!r} returned {len(out)} values for {n} completions")
    vals = np.empty(n, np.float64)
    for i, v in enumerate(out):
        if v is None:
            vals[i] = np.nan
            continue
        try:
            vals[i] = float(v)
        except (TypeError, ValueError):
            raise RewardFunctionError(
                f"reward function {reward.name!r} returned {_short(v)} for row {i} "
                f"(completion {_short(completions[i])}); expected a float or None"
            ) from None
        if not math.isfinite(vals[i]):
            raise RewardFunctionError(
                f"reward function {reward.name!r} returned {v} for row {i} "
                f"(completion {_short(completions[i])}); use None to skip a row"
            )
    return vals


def _find_bad_row(reward, prompts, completions, columns, exc, timeout_s=None, batch="") -> str:
    """Re-run the failing function row by row to name the first row it raises on (each call
    under the same time limit: RewardTimeout, naming the row, if one never returns)."""
    for i in range(len(completions)):
        try:
            call_bounded(
                reward,
                prompts[i : i + 1],
                completions[i : i + 1],
                {k: v if k == "trainer_state" else v[i : i + 1] for k, v in columns.items()},
                timeout_s,
                f"row {i} of {batch or 'a batch'}",
            )
        except RewardTimeout:
            raise
        except Exception as row_exc:  # noqa: BLE001
            chat = isinstance(completions[i], list)  # TRL's conversational form: say so, it may be the cause
            return (
                f"reward function {reward.name!r} raised {type(row_exc).__name__}: {row_exc} on row {i} "
                f"(prompt {_short(prompts[i])}, completion {_short(completions[i])})"
                + (
                    "; the data's prompts are chat messages, so completions arrive as message lists, as TRL "
                    "passes them: read completion[0]['content']"
                    if chat
                    else ""
                )
            )
    return (
        f"reward function {reward.name!r} raised {type(exc).__name__}: {exc} (on the whole batch of {len(completions)})"
    )


@functools.lru_cache(maxsize=256)
def _takes(fn: Any, keyword: str) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: give it only the columns
        return False
    return any(p.kind is p.VAR_KEYWORD or (p.name == keyword and p.kind is not p.POSITIONAL_ONLY) for p in params)


# Passed only to functions that take them (a function written before them may have no **kwargs);
# trainer_state is one object for the batch, not a value per row. Episodes (train.agent) add each
# episode's tool calls and, with an environment, its instance, as TRL's `environments`.
PASSED_TO_REWARDS = ("completion_ids", "trainer_state", "tool_calls", "environments")


@dataclasses.dataclass
class RewardResult:
    total: np.ndarray  # (B,) weighted sum; NaN where no function applies (row excluded)
    per_function: dict[str, np.ndarray]  # name -> (B,) raw values, NaN where None

    @property
    def frac_scored(self) -> float:
        """The fraction of rows some function scored (the others are left out of the loss)."""
        return float(np.mean(~np.isnan(self.total))) if len(self.total) else 0.0


def score(
    rewards: Sequence[Reward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    columns: dict[str, Sequence[Any]] | None = None,
    *,
    timeout_s: float | None = None,
    batch: str = "",
    episodes: Sequence[Any] | None = None,
) -> RewardResult:
    """Each function on the whole batch, and their weighted sum. `timeout_s` bounds each
    function's call (RewardTimeout past it); `batch` says which batch this is in messages
    ("the batch of step 12"). `episodes`: what a user's function reads as each completion where
    the rows are episodes (their messages, for chat data); built-ins read `completions`, the final
    answers."""
    columns = {k: v if k == "trainer_state" else list(v) for k, v in (columns or {}).items()}
    for k, v in columns.items():
        if k != "trainer_state" and len(v) != len(completions):
            raise ValueError(f"column {k!r} has {len(v)} values for {len(completions)} completions")
    per = {}
    weighted = np.zeros(len(completions))
    applies = np.zeros(len(completions), bool)
    for r in rewards:
        cols = {k: v for k, v in columns.items() if k not in PASSED_TO_REWARDS or r.takes(k)}
        seen = completions if episodes is None or r.builtin else episodes
        vals = _call_one(r, list(prompts), list(seen), cols, None if r.model else timeout_s, batch)
        per[r.name] = vals
        ok = ~np.isnan(vals)
        weighted += np.where(ok, vals * r.weight, 0.0)
        applies |= ok
    return RewardResult(np.where(applies, weighted, np.nan), per)


def load_reward(spec: str) -> RewardFn:
    """Load `path/to/file.py:function` or `package.module:function`, or a callable pickled by value
    (`path/to/name.pkl:name`, grpo_core.rewards.by_value: a notebook's reward, local runs only).
    Errors say which part is wrong: ValueError (the spec), FileNotFoundError, ImportError (the
    module, or code in it that fails on import, with the line), AttributeError (no such function),
    TypeError (not callable, or a signature that cannot take (prompts, completions, **columns))."""
    fn = load_code(spec, "reward")
    where, name = spec.rsplit(":", 1)
    return _checked_signature(fn, spec, name, "" if is_pickled(spec) else where)


def _checked_signature(fn: Any, spec: str, name: str, where: str = "") -> RewardFn:
    """`fn`, or TypeError when it is not callable or cannot take (prompts, completions, **columns)."""
    if not callable(fn):
        raise TypeError(f"reward {spec!r}: {where or 'it'}.{name} is a {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have none: let the first call tell
        return fn
    params = sig.parameters.values()
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        raise TypeError(f"reward {spec!r} must accept (prompts, completions, **columns); its signature is {name}{sig}")
    stuck = [p.name for p in positional[2:] if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if stuck:
        raise TypeError(
            f"reward {spec!r}: {name}{sig} takes {', '.join(stuck)} positionally only, but dataset "
            "columns arrive as keywords"
        )
    return fn
