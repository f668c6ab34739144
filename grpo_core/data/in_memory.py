"""Datasets given as Python objects (flows.notebook): a `datasets.Dataset`, a `DatasetDict`, a pandas
DataFrame or a list of row dicts become the JSONL files the data stage reads (data.source,
data.eval_source), written once under storage.root as `_inputs/data/{digest}/{split}.jsonl`.

The digest is of the file's own bytes, and a file already there is never written again: the same
rows give the same path and the same version (size and modification time,
grpo_core.store.versions), so a notebook cell run again names the same run and resumes it; other
rows are another file, a new data hash and a new run. `datasets` is never imported here (a
Dataset is read through its `to_list()`).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import posixpath
from typing import Any, Mapping

from grpo_core.errors import ConfigError
from grpo_core.store.root import RunRoot

INPUTS = "_inputs"  # under storage.root: inputs given as Python objects (these rows, by_value's rewards)
EVAL_SPLITS = ("test", "validation", "eval")  # a DatasetDict's split evaluated on when none is named


def is_in_memory(data: Any) -> bool:
    """Whether `data` is rows in memory (not a source's name: a path, a URL, a Hub id)."""
    return not isinstance(data, (str, bytes)) and data is not None and not hasattr(data, "__fspath__")


def split_rows(
    data: Any, split: str | None = None, eval_split: str | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(training rows, evaluation rows or None) of `data`. A mapping of splits (a DatasetDict)
    trains on `split` (default: train, or its only split) and evaluates on `eval_split` (default:
    test, validation or eval where there is one; else a fraction of the training rows is held out)."""
    if isinstance(data, Mapping):
        if not data or not all(_is_table(v) for v in data.values()):
            raise ConfigError(
                "data: a mapping must hold splits (a DatasetDict, or {'train': rows, 'test': rows}), "
                f"got keys {sorted(map(str, data))[:8]}"
            )
        names = list(data)
        train = split or ("train" if "train" in data else names[0] if len(names) == 1 else None)
        if train not in data:
            raise ConfigError(f"data: no split {train or 'train'!r} to train on; splits: {names} (set data.split)")
        held = eval_split or next((s for s in EVAL_SPLITS if s in data and s != train), None)
        if held is not None and held not in data:
            raise ConfigError(f"data.eval_split {held!r} is not a split of the data; splits: {names}")
        return rows_of(data[train], f"data[{train!r}]"), (rows_of(data[held], f"data[{held!r}]") if held else None)
    if eval_split:
        raise ConfigError(f"data.eval_split {eval_split!r}: the data is one table without splits")
    return rows_of(data, "data"), None


def _is_table(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or hasattr(value, "to_list") or hasattr(value, "to_dict")


def rows_of(data: Any, what: str = "data") -> list[dict[str, Any]]:
    """The rows of a Dataset, a DataFrame or a sequence of dicts, as dicts."""
    if hasattr(data, "to_list") and hasattr(data, "features"):  # datasets.Dataset
        rows = data.to_list()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        rows = data.to_dict("records")
    elif isinstance(data, (list, tuple)):
        rows = list(data)
    else:
        raise ConfigError(
            f"{what}: expected a datasets.Dataset or DatasetDict, a pandas DataFrame, a list of row dicts "
            f"or a data source's name, got {type(data).__name__}"
        )
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, Mapping)), None)
    if bad is not None:
        raise ConfigError(f"{what}: row {bad} is a {type(rows[bad]).__name__}, not a dict of columns")
    if not rows:
        raise ConfigError(f"{what}: there are no rows")
    return [dict(r) for r in rows]


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    """One JSON object per line, in the rows' own order; numpy values and dates as JSON has them."""
    return "".join(json.dumps(r, ensure_ascii=False, default=_plain) + "\n" for r in rows).encode()


def _plain(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        return value.tolist()
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    raise TypeError(f"a value of type {type(value).__name__} ({value!r:.60}) cannot be written as JSON")


def write_rows(rows: list[dict[str, Any]], storage_url: str, split: str) -> str:
    """The URL of `rows` as JSONL under `storage_url` (written once: see the module's doc)."""
    try:
        data = jsonl(rows)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"data ({split}): {exc}") from None
    folder = RunRoot(posixpath.join(storage_url, INPUTS, "data", hashlib.sha256(data).hexdigest()[:16]))
    rel = f"{split}.jsonl"
    if not folder.exists(rel):
        folder.write_bytes(rel, data)
    return folder.uri(rel)
