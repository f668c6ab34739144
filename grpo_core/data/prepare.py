"""Dataset preparation: read prompts from the built-in synthetic task, a JSONL/Parquet/CSV file
(local or gs://) or a Hugging Face dataset; rename columns; read the dataset's shape (GSM8K,
verl, plain: grpo_core.data.formats) into a prompt and a ground_truth; apply a template or the
tokenizer's chat template; tokenize and drop prompts over the length limit; split train/eval;
write them to `data/{hash}/` of the run root with the completion marker last.

Runs inside the Prefect process, so it imports neither JAX nor Prefect (and `datasets` only
when a hub source needs it: it is slow to import).
"""

from __future__ import annotations

import datetime
import io
import json
import logging
import math
import os
import posixpath
from typing import Any

import numpy as np

from grpo_core.config.data import FILE_FORMATS, DataConfig, data_hash  # noqa: F401 - data_hash: importers keep it
from grpo_core.data.formats import (
    REFERENCE_COLUMNS,
    DataFormat,
    apply_format,
    chat_messages,
    column_names,
    detect,
    is_empty,
    is_messages,
    same_columns,
)
from grpo_core.data.synthetic import CharTokenizer, ReverseTask
from grpo_core.errors import DataError, excerpt
from grpo_core.store.root import RunRoot, filesystem

log = logging.getLogger(__name__)

# -- reading -------------------------------------------------------------------------------


def _read_file(url: str) -> list[dict[str, Any]]:
    import pandas as pd  # heavy (~0.5 s): only a file source needs it

    try:
        fs, path = filesystem(url)  # a file rewritten since this process last looked is read whole
        with fs.open(path, "rb") as f:
            raw = f.read()
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read data file {url}: {exc}") from None
    name = url.lower()
    if name.endswith((".jsonl", ".json")):
        text = raw.decode("utf-8", errors="replace")
        if name.endswith(".json") and text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise DataError(f"{url} is not valid JSON: {exc}") from None
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise DataError(f"{url} must hold a JSON array of objects (one per row)")
            return rows
        rows = []
        for i, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{url} line {i} is not valid JSON: {exc.msg}") from None
                if not isinstance(rows[-1], dict):
                    raise DataError(f"{url} line {i} is not a JSON object")
        return rows
    try:
        frame = (
            pd.read_parquet(io.BytesIO(raw))
            if name.endswith(".parquet")
            else pd.read_csv(io.BytesIO(raw), dtype=str, keep_default_na=False)
        )
    except Exception as exc:  # noqa: BLE001 - pandas/pyarrow raise many types for a bad file
        raise DataError(f"cannot read data file {url}: {type(exc).__name__}: {exc}") from None
    return frame.to_dict("records")


def _read_hub(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    """A Hugging Face dataset id (or a local dataset folder) through `datasets`."""
    import datasets  # slow to import (see the module docstring): only a Hub source needs it

    where = f"dataset {cfg.source!r}" + (f" subset {cfg.subset!r}" if cfg.subset else "")
    try:
        if _is_saved_dataset(cfg.source):
            ds = datasets.load_from_disk(cfg.source)
            if not isinstance(ds, datasets.DatasetDict) and (split != "train" or cfg.eval_split):
                missing = split if split != "train" else cfg.eval_split
                raise DataError(
                    f"{where} is a single saved Dataset without splits, so split {missing!r} does not "
                    "exist; leave data.split=train and data.eval_split empty (a fraction is held out)"
                )
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(f"{where} has no split {split!r}; splits: {sorted(ds)}")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(cfg.source, cfg.subset, split=split)
    except DataError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises ValueError, FileNotFoundError, its own types
        raise DataError(f"cannot load {where} split {split!r}: {type(exc).__name__}: {exc}") from None
    return ds.to_list()


def _is_saved_dataset(source: str) -> bool:
    return os.path.isdir(source) and any(
        os.path.exists(os.path.join(source, n)) for n in ("dataset_info.json", "state.json", "dataset_dict.json")
    )


# -- shaping -------------------------------------------------------------------------------


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None  # NaN is not JSON; a missing value is
    if isinstance(v, (datetime.date, datetime.datetime)) or type(v).__name__ == "Timestamp":
        return v.isoformat()
    if isinstance(v, np.ndarray):
        return [_jsonable(x) for x in v.tolist()]
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return v


def _prompt_text(
    cfg: DataConfig, row: dict[str, Any], column: str, i: int, where: str, tokenizer
) -> tuple[str, list[dict[str, Any]] | None]:
    """(the prompt as text, its chat messages or None): data.template over the row, or the prompt
    column; chat messages (and any prompt with data.chat) through the tokenizer's chat template."""
    if cfg.template is not None:
        try:
            prompt = cfg.template.format(**row)
        except KeyError as exc:
            raise DataError(
                f"{where} row {i}: data.template uses column {exc.args[0]!r}, which the row lacks; "
                f"columns: {column_names(row)}"
            ) from None
        except (IndexError, AttributeError, ValueError, TypeError) as exc:
            raise DataError(f"{where} row {i}: data.template cannot be filled: {exc}") from None
    else:
        prompt = row[column]
    if not cfg.chat and not is_messages(prompt):
        if not isinstance(prompt, str):
            raise DataError(
                f"{where} row {i}: column {column!r} must be text, got {type(prompt).__name__} "
                "(or a list of {role, content} chat messages)"
            )
        return prompt, None
    try:
        messages = chat_messages(prompt, cfg.system_prompt)
    except ValueError as exc:
        raise DataError(f"{where} row {i}: column {column!r}: {exc}") from None
    why = "data.chat=true" if cfg.chat else f"row {i}: column {column!r} holds chat messages"
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        raise DataError(
            f"{where} {why}, but the tokenizer has no usable chat template ({type(tokenizer).__name__} "
            "has none); use a Hugging Face tokenizer with one, or text prompts and a data.template"
        )
    try:
        # messages for the rewards only where the data held messages (TRL's conversational rows);
        # a text prompt rendered by data.chat stays text for them, as in TRL
        return apply(messages, tokenize=False, add_generation_prompt=True), messages if is_messages(prompt) else None
    except Exception as exc:  # noqa: BLE001 - no template, or a template that rejects the messages
        raise DataError(
            f"{where} {why}, but the tokenizer has no usable chat template ({type(exc).__name__}: "
            f"{exc}); use text prompts and a data.template"
        ) from None


def _shape_row(cfg: DataConfig, fmt: DataFormat, raw: dict[str, Any], i: int, where: str, tokenizer) -> dict:
    """One row: rename, read its format, render and tokenize the prompt. {"prompt", "prompt_ids",
    **the other columns}; the column the prompt came from is replaced by "prompt"."""
    row = {(cfg.rename or {}).get(k, k): _jsonable(v) for k, v in raw.items()}
    raw_names = set(row)  # the data's own columns (the format may derive ground_truth from one)
    try:
        row, column = apply_format(fmt, row, cfg.prompt_column)
    except ValueError as exc:
        hint = " (or set data.format=plain)" if cfg.format is DataFormat.AUTO else ""
        raise DataError(
            f"{where} row {i} {exc}{hint}" if str(exc).startswith("has ") else f"{where} row {i}: {exc}{hint}"
        ) from None
    if cfg.template is None and column not in row:
        raise DataError(f"{where} row {i} has no column {column!r} (data.prompt_column); columns: {column_names(row)}")
    empty = [c for c in ([] if cfg.template else [column]) if is_empty(row[c])]
    empty += [c for c in REFERENCE_COLUMNS if c in raw_names and is_empty(row.get(c))]
    if empty:
        raise _EmptyValueError(empty)
    prompt, messages = _prompt_text(cfg, row, column, i, where, tokenizer)
    try:
        ids = [int(t) for t in tokenizer.encode(prompt)]
    except ValueError as exc:
        # the built-in tokenizer's reason quotes 40 characters around the character; another's is cut short
        why = str(exc) if isinstance(tokenizer, CharTokenizer) else excerpt(str(exc), 120)
        raise EncodeError(f"{where} row {i}: the tokenizer cannot encode the prompt (model.tokenizer): {why}") from None
    columns = {k: v for k, v in row.items() if k != column}
    # chat prompts keep their messages: reward functions get them as TRL passes conversational data
    return {**columns, "prompt": prompt, "prompt_ids": ids, **({"prompt_messages": messages} if messages else {})}


class EncodeError(DataError):
    """A prompt the run's tokenizer cannot encode: the field to change is model.tokenizer."""


class _EmptyValueError(Exception):
    """A row with an empty prompt or reference answer: dropped and counted by column."""

    def __init__(self, columns: list[str]):
        super().__init__(", ".join(columns))
        self.columns = columns


def _shape(
    cfg: DataConfig, rows: list[dict[str, Any]], where: str, tokenizer, fmt: DataFormat | None = None
) -> tuple[list[dict], dict]:
    """Every row through _shape_row, then the length filter and one set of columns for all rows.
    `fmt`: the format to read the rows in (default: data.format, `auto` resolved on row 0)."""
    if not rows:
        raise DataError(f"{where} has no rows")
    if fmt is None:
        fmt = cfg.format
        if fmt is DataFormat.AUTO:
            fmt = detect({(cfg.rename or {}).get(k, k): _jsonable(v) for k, v in rows[0].items()}, cfg.prompt_column)
    out, lengths, dropped, empty = [], [], 0, {}
    for i, raw in enumerate(rows):
        try:
            row = _shape_row(cfg, fmt, raw, i, where, tokenizer)
        except _EmptyValueError as e:  # never trained on as "", never filed under another reason
            for c in e.columns:
                empty[c] = empty.get(c, 0) + 1
            continue
        lengths.append(len(row["prompt_ids"]))
        if len(row["prompt_ids"]) > cfg.max_prompt_tokens or not row["prompt_ids"]:
            dropped += 1
            continue
        out.append(row)
    n_empty = len(rows) - len(lengths)
    if n_empty:
        log.warning("%s: dropped %d row(s) with an empty value (%s)", where, n_empty, _by_column(empty))
    if not out:
        if not lengths:
            raise DataError(f"{where}: every one of {len(rows)} rows has an empty value ({_by_column(empty)})")
        raise DataError(
            f"{where}: every one of {len(lengths)} prompts"
            + (f" with values ({n_empty} more rows have an empty value: {_by_column(empty)})" if n_empty else "")
            + f" is longer than data.max_prompt_tokens={cfg.max_prompt_tokens} "
            f"(lengths {min(lengths)}..{max(lengths)} tokens)"
        )
    unstorable = same_columns(out)
    if unstorable:
        log.warning("%s: column(s) %s hold values JSON cannot store (bytes, images, ...); left out", where, unstorable)
    kept = [len(r["prompt_ids"]) for r in out]
    return out, {
        "format": fmt.value,
        "dropped_too_long": dropped,
        "dropped_empty": empty,
        "dropped_columns": unstorable,
        "prompt_tokens": {"min": min(kept), "mean": round(float(np.mean(kept)), 2), "max": max(kept)},
    }


def _by_column(counts: dict[str, int]) -> str:
    return ", ".join(f"{c}: {n}" for c, n in counts.items())


def _load_rows(cfg: DataConfig) -> tuple[list[dict], list[dict] | None, str]:
    """(train rows, eval rows or None to hold out a fraction, a name for messages)."""
    if cfg.source == "synthetic":
        task = ReverseTask.of(cfg.task())
        return task.sample(0, 0, cfg.synthetic_rows), task.eval_rows(cfg.eval_rows), "synthetic task"
    if cfg.eval_source is not None and not cfg.is_file and cfg.source != "synthetic":
        return _read_hub(cfg, cfg.split), _read_file(cfg.eval_source), f"dataset {cfg.source!r}"
    if cfg.eval_source is not None:
        if cfg.source == "synthetic":
            raise DataError("data.eval_source evaluates a dataset; the synthetic task has its own eval rows")
        return _read_file(cfg.source), _read_file(cfg.eval_source), cfg.source
    if cfg.is_file:
        return _read_file(cfg.source), None, cfg.source
    if "://" in cfg.source or os.path.isfile(cfg.source):
        raise DataError(
            f"data.source {cfg.source}: unsupported file type; use .jsonl, .json, .parquet or .csv "
            "(or a Hugging Face dataset id or folder)"
        )
    train = _read_hub(cfg, cfg.split)
    return train, (_read_hub(cfg, cfg.eval_split) if cfg.eval_split else None), f"dataset {cfg.source!r}"


def _split(cfg: DataConfig, rows: list[dict], where: str) -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(cfg.seed)
    rows = [rows[i] for i in rng.permutation(len(rows))]
    if cfg.max_rows:
        rows = rows[: cfg.max_rows]
    if len(rows) < 2:
        raise DataError(f"{where}: {len(rows)} usable row(s); a train and an eval split need at least 2")
    n_eval = min(cfg.eval_rows, max(1, round(len(rows) * cfg.eval_fraction)), len(rows) - 1)
    return rows[n_eval:], rows[:n_eval]


def _prepare_rows(cfg: DataConfig, tokenizer) -> tuple[list[dict], list[dict], dict, dict]:
    """(train rows, eval rows, the training rows' stats, the eval rows'): read, shaped, split."""
    raw_train, raw_eval, where = _load_rows(cfg)
    train, stats = _shape(cfg, raw_train, where, tokenizer)
    if raw_eval is None:
        train, evals = _split(cfg, train, where)
        eval_stats = {"dropped_too_long": 0, "dropped_empty": {}, "dropped_columns": []}
    else:  # read in the training split's format, so both splits have the same kind of rows
        label = cfg.eval_source or f"{where} ({cfg.eval_split or 'eval'} split)"
        evals, eval_stats = _shape(cfg, raw_eval, label, tokenizer, DataFormat(stats["format"]))
        if cfg.eval_rows != "all" and len(evals) > cfg.eval_rows:  # a seeded sample, not the split's first rows
            keep = np.sort(np.random.default_rng([cfg.seed, 1]).permutation(len(evals))[: cfg.eval_rows])
            evals = [evals[i] for i in keep]
        if cfg.max_rows:
            train = train[: cfg.max_rows]
    return train, evals, stats, eval_stats


def dry_run(cfg: DataConfig, tokenizer) -> dict[str, Any]:
    """What prepare_dataset would write, counted and written nowhere: every row read, rendered and
    tokenized as the run will, so data the tokenizer cannot encode (or that is empty, or longer
    than data.max_prompt_tokens) fails here, with the DataError the run would raise. `grpo check`."""
    train, evals, stats, eval_stats = _prepare_rows(cfg, tokenizer)
    return {
        "train_rows": len(train),
        "eval_rows": len(evals),
        "format": stats["format"],
        "dropped_too_long": stats["dropped_too_long"] + eval_stats["dropped_too_long"],
        "prompt_tokens": stats["prompt_tokens"],
    }


def first_row_format(cfg: DataConfig) -> tuple[str, list[str]]:
    """(the format the data reads as, the columns of its first training row read in it: renamed,
    with ground_truth where gsm8k or verl derives one), as preparation reads them; nothing
    tokenized. Which default rewards fit (grpo_core.resolve). DataError where
    the data cannot be read, or its first row not in that format."""
    raw, _, where = _load_rows(cfg)
    if not raw:
        raise DataError(f"{where} has no rows")
    row = {(cfg.rename or {}).get(k, k): _jsonable(v) for k, v in raw[0].items()}
    fmt = detect(row, cfg.prompt_column) if cfg.format is DataFormat.AUTO else cfg.format
    try:
        row, column = apply_format(fmt, row, cfg.prompt_column)
    except ValueError as exc:
        raise DataError(f"{where} row 0 {exc}") from None
    if cfg.template is None and column not in row:  # data the run cannot read: its data stage says so first
        raise DataError(f"{where} row 0 has no column {column!r} (data.prompt_column); columns: {column_names(row)}")
    return fmt.value, sorted(row)


def prepare_dataset(
    cfg: DataConfig, tokenizer, root: RunRoot, tokenizer_id: str, versions: dict[str, str] | None = None
) -> dict[str, Any]:
    """Write data/{hash}/train.jsonl, eval.jsonl, manifest.json, then the marker. A finished
    stage (its marker present) is read back, not redone. `versions`: of the sources read
    (RunConfig.data_versions), part of the hash and recorded in the manifest."""
    h = data_hash(cfg, tokenizer_id, versions)
    stage = f"data/{h}"
    if root.is_done(stage):
        return dict(root.done_info(stage), cached=True)
    train, evals, stats, eval_stats = _prepare_rows(cfg, tokenizer)
    for name, rows in (("train", train), ("eval", evals)):
        root.write_bytes(posixpath.join(stage, f"{name}.jsonl"), "".join(json.dumps(r) + "\n" for r in rows).encode())
    manifest = {
        "source": cfg.source,
        "versions": versions or {},
        "subset": cfg.subset,
        "split": cfg.split,
        "eval_split": cfg.eval_split,
        "eval_source": cfg.eval_source,
        "format": stats["format"],
        "hash": h,
        "uri": root.uri(stage),
        "train_rows": len(train),
        "eval_rows": len(evals),
        "dropped_too_long": stats["dropped_too_long"] + eval_stats["dropped_too_long"],
        # rows with an empty prompt or reference answer, by column (a row counts under each empty one)
        "dropped_empty": {
            c: stats["dropped_empty"].get(c, 0) + eval_stats["dropped_empty"].get(c, 0)
            for c in {**stats["dropped_empty"], **eval_stats["dropped_empty"]}
        },
        "dropped_columns": sorted(set(stats["dropped_columns"]) | set(eval_stats["dropped_columns"])),
        "prompt_tokens": stats["prompt_tokens"],
        "columns": sorted(train[0]),
        "tokenizer": tokenizer_id,
    }
    root.write_json(posixpath.join(stage, "manifest.json"), manifest)
    root.mark_done(stage, manifest)  # last: the marker means every output above is complete
    return dict(manifest, cached=False)


def load_prepared(root: RunRoot, h: str) -> tuple[list[dict], list[dict]]:
    stage = f"data/{h}"
    if not root.is_done(stage):
        raise DataError(f"{root.uri(stage)} is not complete (no marker): run the prepare-dataset stage first")
    read = lambda name: [json.loads(x) for x in root.read_bytes(f"{stage}/{name}.jsonl").decode().splitlines()]
    return read("train"), read("eval")


class DatasetPrompts:
    """Prompts for step s: a pure function of (seed, step, round), so a resumed run sees the
    same ones. Round 0 walks an endless stream of epoch-wise shuffles; refill rounds of dynamic
    sampling draw at random."""

    def __init__(self, rows: list[dict[str, Any]], seed: int = 0):
        if not rows:
            raise ValueError("DatasetPrompts needs at least one row")
        self.rows, self.seed = rows, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))}
        return self._perms[epoch]

    def sample(self, step: int, round_: int, n: int) -> list[dict[str, Any]]:
        if round_ > 0:
            idx = np.random.default_rng([self.seed, step, round_]).integers(0, len(self.rows), n)
            return [self.rows[i] for i in idx]
        m = len(self.rows)
        return [self.rows[self._perm(pos // m)[pos % m]] for pos in range(step * n, step * n + n)]
