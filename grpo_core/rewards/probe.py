"""Before training: can the rewards score this data at all?

A reward returns None for a row it does not apply to, and a row no reward applies to is left out
of the loss. When a reward can score none of the rows (math_answer on data without a
`ground_truth` column: data.format=plain, or a renamed question column), every step trains on
nothing: reward NaN, loss 0, grad norm 0, an eval accuracy of NaN, and a run that "completes".
This module finds that in a second at the data stage, by calling each reward on a few prepared
rows with completions that should score (the row's own reference answer, bare and in the usual
answer formats), and checks that each reward's signature takes the data's columns.

JAX-free: it runs in the Prefect process, after the data is prepared.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Sequence

import numpy as np

from grpo_core.config.run import RunConfig
from grpo_core.data.formats import REFERENCE_COLUMNS
from grpo_core.data.prepare import load_prepared
from grpo_core.errors import ConfigError, DataError, RewardFunctionError, RewardTimeout
from grpo_core.rewards.functions import (
    PASSED_TO_REWARDS,
    Reward,
    ThreadedRewardError,
    TrainerState,
    reward_inputs,
    score,
)
from grpo_core.rewards.registry import config_rewards

SAMPLE_ROWS = 32  # rows each reward is tried on, spread over the split
# Where a row's reference answer may be, in order: the math formats' ground_truth, then the
# names datasets commonly give it.
MATH_BUILTINS = ("math_answer",)  # built-ins that read the ground_truth column


@dataclasses.dataclass(frozen=True)
class Coverage:
    """One reward tried on `rows` rows: how many some probe scored, and with which probe."""

    reward: Reward
    split: str  # "training" or "evaluation"
    rows: int
    scored: int
    probe: str | None  # the probe that scored, None when none did
    failed: tuple[str, ...] = ()  # probes the function raised on (not evidence either way)
    references: int = 0  # sampled rows with a reference answer
    columns: tuple[str, ...] = ()  # the columns those came from (REFERENCE_COLUMNS)
    mean: float | None = None  # the mean score of the rows the probe scored

    def describe(self) -> str:
        """What was compared, e.g. "'math_answer': 32/32 sampled training rows hold a reference answer
        (ground_truth); given it as the completion, the reward scored 32/32, mean 1": a scored count
        alone read as all-clear for a reward comparing with another column (issue 53)."""
        if self.scored:
            held = (
                f"{self.references}/{self.rows} sampled {self.split} rows hold a reference answer "
                f"({', '.join(self.columns)})"
                if self.references
                else f"none of {self.rows} sampled {self.split} rows holds a reference answer"
            )
            given = "given it as the completion" if self.probe == _PROBES[0][0] else f"given {self.probe}"
            scored = f"the reward scored {self.scored}/{self.rows}, mean {self.mean:.3g}"
            return f"{self.reward.name!r}: {held}; {given}, {scored}"
        if len(self.failed) == len(_PROBES):
            return f"{self.reward.name!r} not judged: it raised on every probe ({self.failed[0]})"
        return f"{self.reward.name!r} scored none of {self.rows} sampled {self.split} rows"


def sample(rows: Sequence[dict[str, Any]], n: int = SAMPLE_ROWS) -> list[dict[str, Any]]:
    """Up to n rows spread evenly over `rows` (a split grouped by source is sampled from each part)."""
    if len(rows) <= n:
        return list(rows)
    return [rows[int(i)] for i in np.linspace(0, len(rows) - 1, n).round()]


def reference(row: dict[str, Any]) -> str:
    """The row's reference answer as text (the first acceptable one of a list), or ''."""
    return _reference(row)[1]


def _reference(row: dict[str, Any]) -> tuple[str | None, str]:
    """(the column, the reference answer as text), or (None, '')."""
    for key in REFERENCE_COLUMNS:
        v = row.get(key)
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if isinstance(v, bool) or v is None or not isinstance(v, (str, int, float)) or not str(v).strip():
            continue
        return key, str(v)
    return None, ""


# (what the message calls it, completion from the reference answer)
_PROBES = (
    ("the row's reference answer as the completion", lambda a: a),
    ("<think>...</think><answer>reference</answer>", lambda a: f"<think>\n</think>\n<answer>{a}</answer>"),
    ("\\boxed{reference}", lambda a: f"The answer is \\boxed{{{a}}}."),
    ("an empty completion", lambda a: ""),
)


def _columns(rows: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """The dataset columns a reward receives as keywords, exactly as the trainer builds them."""
    return reward_inputs(rows, [""] * len(rows))[2]


# What only episodes (train.agent) pass to the reward functions that take them
EPISODE_KEYWORDS = ("tool_calls", "environments")


def check_signature(reward: Reward, columns: Sequence[str], where: str, episodes: bool = False) -> None:
    """ConfigError naming the reward's field when it cannot be called as f(prompts, completions,
    **columns) with these columns: it requires a column the data lacks, or takes no **kwargs
    and the data has a column it does not name. `episodes`: the run's rows are episodes, which
    pass tool_calls and environments too."""
    try:
        sig = inspect.signature(reward.fn)
    except (TypeError, ValueError):  # some callables have none: the first call tells
        return
    arrive = [k for k in PASSED_TO_REWARDS if (episodes or k not in EPISODE_KEYWORDS) and reward.takes(k)]
    try:
        sig.bind([], [], **dict.fromkeys([*columns, *arrive], []))
        return
    except TypeError as exc:
        why = str(exc)
    params = list(sig.parameters.values())
    named = {p.name for p in params}
    given = {*columns, *PASSED_TO_REWARDS}  # completion_ids and trainer_state always arrive
    missing = [
        p.name
        for p in params[2:]
        if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in given
    ]
    extra = [c for c in columns if c not in named] if not any(p.kind is p.VAR_KEYWORD for p in params) else []
    label = reward.field or repr(reward.name)
    needs = [k for k in EPISODE_KEYWORDS if k in named and not episodes]
    if needs:
        raise ConfigError(
            f"{label} {reward.spec or reward.name!r}: {reward.name}{sig} reads {', '.join(map(repr, needs))}, which "
            "only episodes give: set train.agent.tools or train.agent.environment (docs: Agents and tools)"
        )
    if missing:
        detail = (
            f"reads column(s) {', '.join(map(repr, missing))}, which the prepared {where} does not have "
            f"(columns: {', '.join(sorted(columns)) or 'none'}); check data.format, data.rename and data.prompt_column"
        )
    elif extra:
        detail = (
            f"takes no keyword for column(s) {', '.join(map(repr, extra))} of the prepared {where}, and every "
            "column is passed as a keyword: add **kwargs to its parameters"
        )
    else:
        detail = why
    raise ConfigError(f"{label} {reward.spec or reward.name!r}: {reward.name}{sig} {detail}")


def probe(
    reward: Reward, rows: list[dict[str, Any]], split: str, timeout_s: float | None = None, episodes: bool = False
) -> Coverage:
    """Call `reward` on `rows` with each probe's completions until one scores a row (`episodes`:
    as episodes that made no call)."""
    found = [_reference(r) for r in rows]
    refs = [a for _, a in found]
    held = dict(references=sum(c is not None for c, _ in found), columns=tuple(dict.fromkeys(c for c, _ in found if c)))
    failed = []
    for label, make in _PROBES:
        texts = [make(a) for a in refs]
        # chat rows: messages; stand-in ids (one per character) and step 0 for functions that read them
        prompts, completions, columns = reward_inputs(
            rows, texts, completion_ids=[[0] * len(t) for t in texts], state=TrainerState(0, 0)
        )
        if episodes:
            columns["tool_calls"] = [[] for _ in texts]
        try:
            result = score(
                [reward],
                prompts,
                completions,
                columns,
                timeout_s=timeout_s,
                batch=f"the reward probe of {len(rows)} {split} rows at the data stage ({label})",
            )
        except (RewardTimeout, ThreadedRewardError):
            raise  # it would hang, or fail, on the model's completions too
        except RewardFunctionError as exc:
            # A function may reject these made-up completions and still score the model's; a real
            # error shows up, with its row, in the first training step.
            failed.append(f"{label}: {exc}")
            continue
        scores = np.asarray(result.per_function[reward.name], dtype=float)
        scored = int(np.sum(~np.isnan(scores)))
        if scored:
            mean = float(np.nanmean(scores))
            return Coverage(reward, split, len(rows), scored, label, tuple(failed), mean=mean, **held)
    return Coverage(reward, split, len(rows), 0, None, tuple(failed), **held)


def _cause(reward: Reward, rows: list[dict[str, Any]], columns: list[str], cfg: RunConfig, fmt: str) -> str:
    """The likeliest reason a reward scores nothing, and what to change."""
    try:
        reads_truth = reward.name in MATH_BUILTINS or "ground_truth" in inspect.signature(reward.fn).parameters
    except (TypeError, ValueError):
        reads_truth = reward.name in MATH_BUILTINS
    cols = ", ".join(sorted(columns)) or "none"
    if reads_truth and "ground_truth" not in columns:
        auto = " (data.format=auto found no gsm8k or verl row)" if cfg.data.format.value == "auto" else ""
        return (
            f"the prepared rows have no 'ground_truth' column (columns: {cols}), which it reads: data.format=gsm8k "
            f"or verl writes one, and this data was read as {fmt}{auto}; set data.format, or check data.rename and "
            "data.prompt_column for a renamed question or answer column"
        )
    if reads_truth and all(not str(r.get("ground_truth") or "").strip() for r in rows):
        return f"the sampled rows' ground_truth values are all empty (columns: {cols}); check the dataset's answers"
    return (
        f"check the columns it reads against the prepared rows' columns ({cols}) and data.format "
        f"(read as {fmt}) / data.rename"
    )


def check_coverage(
    cfg: RunConfig,
    rewards: Sequence[Reward],
    eval_rewards: Sequence[Reward],
    train_rows: list[dict[str, Any]],
    eval_rows: list[dict[str, Any]],
    fmt: str,
) -> list[Coverage]:
    """Check every reward's signature against the data's columns, and that each reward with a
    weight above 0 scores some sampled training row and eval.accuracy_reward some evaluation row.
    ConfigError (a signature) or DataError (a reward that scores nothing), naming the reward's
    field, the data and the likely cause; RewardTimeout for a reward that does not return within
    train.reward_timeout_s. Returns what each probe found (for the log). A reward model is not
    probed: it scores every row, and it runs on the devices (in the training worker)."""
    source = f"data.source {cfg.data.source!r}"
    found = []
    for split, rows, rws, judged in (
        ("training", sample(train_rows), rewards, [r for r in rewards if r.weight > 0 and not r.model]),
        (
            "evaluation",
            sample(eval_rows),
            eval_rewards,
            [r for r in eval_rewards if r.name == cfg.eval.accuracy_reward and not r.model],
        ),
    ):
        if not rows:
            continue
        columns = list(_columns(rows))
        agentic = cfg.train.agent.enabled
        for r in rws:
            if not r.model:  # a reward model takes what TRL gives one
                check_signature(r, columns, f"{split} rows of {source}", agentic)
        for r in judged:
            c = probe(r, rows, split, cfg.train.reward_timeout_s, agentic)
            found.append(c)
            if c.scored or c.failed:
                continue  # scored, or raised on a probe: not evidence that it can score nothing
            what = (
                "every row would be left out of the loss and the run would learn nothing"
                if split == "training"
                else "the evaluation accuracy (eval.accuracy_reward) would be NaN"
            )
            tried = (
                "even with the row's own reference answer as the completion"
                if any(reference(row) for row in rows)
                else "for every completion tried (the rows have no reference answer column)"
            )
            raise DataError(
                f"{r.field or 'reward'} {r.spec or r.name!r} scored none of {c.rows} sampled {split} rows of "
                f"{source} (read as {fmt}): it returned None for every row, {tried}, so {what}. "
                f"Likely cause: {_cause(r, rows, columns, cfg, fmt)}"
            )
    return found


def check_prepared(cfg: RunConfig, root, skip_missing: bool = False) -> list[Coverage]:
    """check_coverage on the run's prepared data (data/{hash}/ of `root`, a RunRoot) with the
    config's rewards (those not found here skipped when `skip_missing`: see make_rewards)."""
    stage = f"data/{cfg.data_hash}"
    manifest = root.done_info(stage) if root.is_done(stage) else {}
    train_rows, eval_rows = load_prepared(root, cfg.data_hash)
    rewards, eval_rewards = config_rewards(cfg, skip_missing)
    return check_coverage(cfg, rewards, eval_rewards, train_rows, eval_rows, manifest.get("format", "?"))
