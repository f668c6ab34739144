"""Dataset shapes people bring, turned into rows of one kind: a prompt (text or chat messages)
and, for math data, a `ground_truth` column the built-in math rewards compare with.

    plain  the prompt column (or data.template) as it is; a `solution` column (TRL's math datasets'
           reference) is the ground_truth where the rows have none; with no `prompt` column, a
           conversation in `messages` is the prompt, up to its last user turn
    gsm8k  `question`, and `answer` = a worked solution ending in '#### 42' (openai/gsm8k):
           ground_truth '42'; the solution stays in `answer`
    verl   verl's RL parquet: `prompt` = a list of {role, content} messages, the reference in
           `ground_truth` or `reward_model.ground_truth`; data_source, extra_info, ... stay columns
    auto   gsm8k or verl when the first row looks like one, else plain

Helpers here raise ValueError with what is wrong in the row; grpo_core.data.prepare adds the file and
the row number. Messages (a list of {role, content}) go through the tokenizer's chat template
in every format. Prepared rows all carry the same columns (same_columns).
"""

from __future__ import annotations

import json
import re
from typing import Any

from grpo_core.config.data import DataFormat  # the data section's choice; re-exported
from grpo_core.errors import excerpt


def is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


def _verl_truth(row: dict[str, Any]) -> tuple[bool, Any]:
    """(found, value): a top-level `ground_truth`, else `reward_model.ground_truth` (a Parquet
    file whose rows mix both has a top-level column that is null where a row lacks it)."""
    rm = row.get("reward_model")
    nested = isinstance(rm, dict) and "ground_truth" in rm
    if "ground_truth" in row and (row["ground_truth"] is not None or not nested):
        return True, row["ground_truth"]
    if nested:
        return True, rm["ground_truth"]
    return False, None


def completion_text(completion: Any) -> str:
    """A completion as text: a chat-style one (a list of messages) is read from its last message."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return completion if isinstance(completion, str) else str(completion)


CONVERSATION = "messages"  # the column chat exports name a conversation by (TRL's language-modeling format)


def prompt_column_of(row: dict[str, Any], prompt_column: str) -> str:
    """The column a row's prompt is read from: data.prompt_column, or where that is the default
    'prompt' and the row has none, a conversation in `messages` (chat exports name it so)."""
    if prompt_column == "prompt" and "prompt" not in row and is_messages(row.get(CONVERSATION)):
        return CONVERSATION
    return prompt_column


def detect(row: dict[str, Any], prompt_column: str) -> DataFormat:
    """What `auto` resolves to, from the first row (after data.rename)."""
    prompt_column = prompt_column_of(row, prompt_column)
    if "question" in row and isinstance(row.get("answer"), str) and "####" in row["answer"]:
        return DataFormat.GSM8K
    if is_messages(row.get(prompt_column)) and _verl_truth(row)[0]:
        return DataFormat.VERL
    return DataFormat.PLAIN


_SPACES = re.compile(r"\s+")


def gsm8k_truth(answer: Any) -> str:
    """'... so 1,200 in all.\\n#### 1,200' -> '1200': the text after the last '####', without
    thousands separators or spaces."""
    if not isinstance(answer, str) or "####" not in answer:
        raise ValueError(f"answer has no '#### <number>' (data.format=gsm8k): {_short(answer)}")
    truth = _SPACES.sub("", answer.rsplit("####", 1)[1]).replace(",", "")
    if not truth:
        raise ValueError(f"answer has nothing after its last '####' (data.format=gsm8k): {_short(answer)}")
    return truth


# Columns that hold a row's reference answer, in the order a reward probe looks for one; an empty
# value in one of them drops the row at preparation (grpo_core.data.prepare), like an empty prompt.
REFERENCE_COLUMNS = ("ground_truth", "answer", "solution", "target", "label", "reference", "response", "completion")


def is_empty(value: Any) -> bool:
    """No value: None, NaN (an empty CSV or parquet cell), blank text, an empty list."""
    if value is None or (isinstance(value, float) and value != value):
        return True
    if isinstance(value, str):
        return not value.strip()
    return isinstance(value, (list, tuple, dict)) and not value


def apply_format(fmt: DataFormat, row: dict[str, Any], prompt_column: str) -> tuple[dict[str, Any], str]:
    """(the row with ground_truth added, the column the prompt comes from). A conversation in
    `messages` (prompt_column_of) is the prompt up to its last user turn: the assistant's
    answers after it are what the policy is to write, not its prompt."""
    column = prompt_column_of(row, prompt_column)
    if column == CONVERSATION and column != prompt_column:
        turns = list(row[column])
        while turns and turns[-1].get("role") == "assistant":
            turns.pop()
        if not turns:
            raise ValueError(f"column {column!r} holds only assistant messages: nothing is left to prompt with")
        row, prompt_column = dict(row, **{column: turns}), column
    if fmt is DataFormat.GSM8K:
        column = prompt_column if prompt_column in row else "question"
        if column not in row:
            raise ValueError(f"has no column 'question' (data.format=gsm8k); columns: {column_names(row)}")
        if "answer" not in row:
            raise ValueError(f"has no column 'answer' (data.format=gsm8k); columns: {column_names(row)}")
        return dict(row, ground_truth=gsm8k_truth(row["answer"])), column
    if fmt is DataFormat.VERL:
        found, truth = _verl_truth(row)
        if not found:
            raise ValueError(
                "has no 'ground_truth' column nor reward_model.ground_truth (data.format=verl); "
                f"columns: {column_names(row)}"
            )
        if isinstance(truth, (int, float)) and not isinstance(truth, bool):
            truth = str(truth)  # one type per column; the math rewards read text
        return dict(row, ground_truth=truth), prompt_column
    if "ground_truth" not in row and isinstance(row.get("solution"), str) and row["solution"].strip():
        # TRL's math datasets and its accuracy_reward name the reference answer `solution`
        return dict(row, ground_truth=row["solution"]), prompt_column
    return row, prompt_column


def chat_messages(prompt: Any, system_prompt: str | None) -> list[dict[str, Any]]:
    """A prompt as chat messages: text becomes one user message; the system prompt goes first
    unless the messages bring their own."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    if not is_messages(messages):
        raise ValueError(
            f"a chat prompt must be text or a non-empty list of {{role, content}} messages, got {_short(prompt)}"
        )
    if system_prompt and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def same_columns(rows: list[dict[str, Any]]) -> list[str]:
    """Give every row every column (None where a row lacks one: rewards receive one list per
    column, and a row without a ground_truth is one the math rewards skip) and drop the columns
    JSON cannot store. Returns the dropped names."""
    names = list(dict.fromkeys(k for r in rows for k in r))
    bad: set[str] = set()
    for r in rows:
        try:
            json.dumps(r)
        except (TypeError, ValueError):
            bad.update(k for k, v in r.items() if not _storable(v))
    for r in rows:
        for k in names:
            r.setdefault(k, None)
        for k in bad:
            del r[k]
    return sorted(bad)


def _storable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def _short(v: Any, n: int = 40) -> str:
    """A value of a row in an error: a bounded excerpt (grpo_core.errors.excerpt), never the row."""
    return excerpt(v, n)


def column_names(row: dict[str, Any], most: int = 20) -> str:
    """A row's column names in an error, as a list: at most `most` of them, each cut at 40
    characters (names are the file's text too)."""
    names = sorted(str(k) for k in row)
    shown = repr([k if len(k) <= 40 else k[:37] + "..." for k in names[:most]])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
