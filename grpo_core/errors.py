"""The failures a user can act on, and what each means once it leaves the worker process.

A stage's worker and the Prefect task that launched it meet only at an exit code (and the
worker's last "error" event): the worker turns an exception into a code, the task turns the code
back into whether a retry can help and what to tell the user. Both halves read the one table
here, so a new failure cannot be retried on one side and not the other. This module imports
nothing from grpo_core and no JAX: the Prefect process imports it and must never start JAX.

Out-of-memory is recognised by grpo_core.config.memory.is_out_of_memory (XLA reports it as a
runtime error whose text says so, not as a class of its own); the worker asks it about
exceptions this table does not know.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import json


class ConfigError(ValueError):
    """A configuration value a user chose is invalid. The message names the field."""


class DataError(ValueError):
    """Bad data a user provided. The message names the file or dataset, the column or the row."""


class RewardFunctionError(RuntimeError):
    """A user's reward function misbehaved. The message names the function and the row."""


class RewardTimeout(RewardFunctionError):  # noqa: N818  (a public name, like RolloutTimeout)
    """A reward function did not return within train.reward_timeout_s on one batch; the message
    names the function, the batch and the limit. Its call still runs in a thread that cannot be
    stopped, so a worker exits without joining it (grpo_core.stages.worker)."""


class StorageError(RuntimeError):
    """The storage root cannot be used. The message names the URL."""


class LastingStorageError(StorageError):
    """The storage root fails for a cause that stays until someone changes it: permission
    denied, a read-only file system, a path in it that is a file, no space left. Neither a task
    nor the flow retries it. A StorageError whose exception chain shows such a cause is
    classified as one (storage_cause_lasts); it may also be raised as itself."""


# errnos of storage causes that a retry cannot fix (and the texts gcsfs and fsspec give them)
LASTING_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR})
_LASTING_TEXTS = ("No space left on device", "Read-only file system", "Permission denied", "Not a directory")


def storage_cause_lasts(exc: BaseException) -> bool:
    """Whether `exc` or what it was raised from is a storage failure a retry cannot fix: the
    causes grpo_core.store.root.describe_storage_error names as permission, read-only, no space,
    or a file where a folder should be. A network failure or an unknown cause may pass: False."""
    e, seen = exc, 0
    while e is not None and seen < 8:
        if isinstance(e, LastingStorageError) or isinstance(e, (PermissionError, NotADirectoryError)):
            return True
        if isinstance(e, OSError) and e.errno in LASTING_STORAGE_ERRNOS:
            return True
        if isinstance(e, OSError) and any(t in str(e) for t in _LASTING_TEXTS):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


class RunRootInUse(ConfigError):  # noqa: N818  (a public name, like RolloutTimeout)
    """Another run owns the run root (its lease is live), or took it over from this one
    (grpo_core.store.lease). The message names the owner and what to do; retrying fails the same
    way, so it is a ConfigError: wait, or choose another run_name or storage.root. It is raised in
    the Prefect process only, so it needs no row of its own (classify finds ConfigError's)."""


class DamagedFile(ConfigError):  # noqa: N818  (a public name, like RunRootInUse)
    """A file of the run root cannot be read as what it holds (a JSON file cut short by a crash
    mid-write on a filesystem without atomic renames, or by a partial upload). The message names
    its URI and the parse error. The same bytes fail the same way, so it is not retried: restore
    or delete the file. A ConfigError, so it needs no row of its own."""


class NonFiniteError(FloatingPointError):
    """A training metric became NaN/Inf. The message names the step and the metric."""


class DistributedError(RuntimeError):
    """The distributed setup is wrong or broke; the message names the variable or the process."""


class RolloutError(RuntimeError):
    """A rollout engine failed; the message names the engine and what it was doing."""


class RolloutTimeout(RolloutError):  # noqa: N818  (a public name)
    """An engine wait passed its time limit; the message names what was waited for."""


class RunInterrupted(KeyboardInterrupt):
    """The user (Ctrl-C) or a scheduler (SIGTERM) stopped the run: its workers were stopped at a
    step boundary where they could save one. A KeyboardInterrupt, so Prefect records the run as
    crashed and retries neither the task nor the flow; the message says where it resumes."""


class ExitCode(enum.IntEnum):
    """A worker's (or the readiness check's) exit code. Anything else, a crash (1) or a signal,
    is worth a retry: the next run resumes from the last checkpoint."""

    OK = 0
    CONFIG = 2  # a config or data error (and the readiness check's invalid request)
    REWARD = 3
    NOT_READY = 4  # the readiness check ran and a check failed (`grpo check` exits with it too)
    STORAGE = 5
    DIVERGED = 6  # NaN/Inf
    ROLLOUT = 7  # the rollout engine failed or passed a time limit, possibly where a wait could not be interrupted
    DISTRIBUTED = 8  # jax.distributed could not start, or the processes disagree
    MEMORY = 9  # out of device or host memory
    INTERRUPTED = 10  # SIGTERM/SIGINT: stopped at a step boundary (a checkpoint saved) or after its grace period
    STORAGE_LASTING = 11  # a storage error that a retry cannot fix (permission, read-only, not a folder, no space)

    @property
    def kind(self) -> str:
        """How the task's failure message names it."""
        return _KINDS[self]


_KINDS = {
    ExitCode.OK: "done",
    ExitCode.CONFIG: "config or data error",
    ExitCode.REWARD: "reward function error",
    ExitCode.NOT_READY: "not ready",
    ExitCode.STORAGE: "storage error",
    ExitCode.DIVERGED: "training diverged",
    ExitCode.ROLLOUT: "rollout engine failed or timed out",
    ExitCode.DISTRIBUTED: "multi-host setup failed",
    ExitCode.MEMORY: "out of memory",
    ExitCode.INTERRUPTED: "interrupted",
    ExitCode.STORAGE_LASTING: "storage error that a retry cannot fix",
}


@dataclasses.dataclass(frozen=True)
class Failure:
    """What an exception becomes in the worker: its exit code, the `kind` of its error event, and
    whether running the stage again can help (a config, data or reward error, a divergence or an
    allocation that does not fit fails the same way every time)."""

    code: ExitCode
    event: str
    retryable: bool


OUT_OF_MEMORY = Failure(ExitCode.MEMORY, "memory", False)
_CONFIG = Failure(ExitCode.CONFIG, "config", False)

# Exception type -> Failure. classify() looks an exception's classes up most specific first (as the
# worker's except clauses did), so a subclass given a row of its own wins over its base's.
FAILURES: dict[type[BaseException], Failure] = {
    StorageError: Failure(ExitCode.STORAGE, "storage", True),
    LastingStorageError: Failure(ExitCode.STORAGE_LASTING, "storage", False),
    FileNotFoundError: _CONFIG,  # no config.json, a missing config file or checkpoint
    ConfigError: _CONFIG,
    json.JSONDecodeError: _CONFIG,  # a config file that is not JSON
    DataError: Failure(ExitCode.CONFIG, "data", False),
    RewardFunctionError: Failure(ExitCode.REWARD, "reward", False),
    NonFiniteError: Failure(ExitCode.DIVERGED, "diverged", False),
    DistributedError: Failure(ExitCode.DISTRIBUTED, "distributed", True),
    RolloutError: Failure(ExitCode.ROLLOUT, "rollout", True),
    # a worker stopped by SIGTERM/SIGINT it did not expect (not this run's own Ctrl-C, which the task
    # knows): something else stopped it, and a retry resumes from its checkpoint
    RunInterrupted: Failure(ExitCode.INTERRUPTED, "interrupted", True),
    MemoryError: OUT_OF_MEMORY,  # the host's; XLA's device allocation failures: is_out_of_memory
}

NOT_RETRYABLE = frozenset(f.code for f in FAILURES.values() if not f.retryable)

# What to change when a run does not fit (the worker's error for XLA's allocation failure and the
# task's message for a kill by the kernel say the same).
OUT_OF_MEMORY_LEVERS = (
    "lower train.grpo.prompts_per_step or train.sampling.max_new_tokens, set train.remat=full "
    "and train.grpo.grad_accum_steps=auto, use LoRA (model.lora) or bfloat16 "
    "(model.param_dtype), or shard over more devices (train.mesh); `grpo check` shows the estimate"
)


def classify(exc: BaseException) -> Failure | None:
    """The row for `exc`, from its most specific class that has one; None for an exception the
    table does not know (a bug, or an allocation failure only is_out_of_memory recognises)."""
    if isinstance(exc, StorageError) and storage_cause_lasts(exc):
        return FAILURES[LastingStorageError]
    for cls in type(exc).__mro__:
        if cls in FAILURES:
            return FAILURES[cls]
    return None


def is_retryable(code: int) -> bool:
    """Whether a worker that exited with `code` (negative: killed by that signal) may succeed
    when run again."""
    return code not in NOT_RETRYABLE


def excerpt(text: object, limit: int = 40, at: int | None = None) -> str:
    """At most `limit` characters of `text` (around position `at`, where given; another value: of
    its repr), quoted as repr quotes them (control characters, a terminal's escape sequences
    included, escaped) with '...' where it goes on: all an error may show of a data file's row or
    of a server's answer."""
    s = text if isinstance(text, str) else repr(text)
    start = 0 if at is None else max(0, min(at - limit // 2, len(s) - limit))
    piece = s[start : start + limit]
    shown = repr(piece) if isinstance(text, str) else "".join(c if c.isprintable() else repr(c)[1:-1] for c in piece)
    return ("..." if start > 0 else "") + shown + ("..." if start + limit < len(s) else "")
