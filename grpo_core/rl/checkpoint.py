"""Checkpoints of a training run with Orbax: everything needed to continue exactly.

A checkpoint holds the train state (parameters, optimizer state, update count) and a small
JSON record: the next step to run, the seed and the config hash. Prompts and PRNG keys are pure
functions of (seed, step), so the step *is* the position in the data and the PRNG state.

Orbax writes each checkpoint to a temporary name and finalises it last, and `latest_step`
only sees finalised ones: a save cut off half-way is never restored. Saves are asynchronous;
`wait()` blocks until the last one is durable. Orbax addresses local folders and `gs://`
(TensorStore) alike; the tests here cover local folders, and the pipeline's tests run it
against a GCS emulator.

A finalised checkpoint can still be unreadable (a file truncated or deleted afterwards, a disk
or bucket gone wrong). `restore` then raises UnreadableCheckpointError naming the folder, and
`restore_newest` (what resuming training uses) sets that folder aside under
`{directory}/_set_aside/{step}-{UTC time}/` (moved, never deleted) and falls back to the next
older checkpoint, so one bad checkpoint costs the steps since the one before, not the run.

Sharded and multi-host: every process calls save and restore (Orbax coordinates them; each
writes and reads its own shards). `restore(step, like)` lays the arrays out as `like`'s are,
so a run resumes on another mesh or another number of hosts; `restore(step)` gives every
process whole arrays on its own first device, whatever mesh wrote them (evaluation, export).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import posixpath
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from grpo_core.config.memory import is_out_of_memory
from grpo_core.errors import LastingStorageError, StorageError
from grpo_core.store.root import filesystem

log = logging.getLogger(__name__)

# Where checkpoints that failed to restore are moved, inside the checkpoints folder. Neither
# reader of that folder counts it as a step: Orbax's manager takes only names that are a step
# number (no prefix is configured here) and, on gs://, only folders holding its
# commit_success.txt, which this one never does; grpo_core.store.report.latest_checkpoint takes
# only all-digit names.
SET_ASIDE = "_set_aside"


# Checkpointer.restore(..., layout=HOST): the arrays as numpy, in this process's memory
HOST = "host"

# An asynchronous run's batches drawn but not yet trained (grpo_core.rl.overlap.to_saved): two more
# items of the checkpoint, its arrays and their record, written and finalised with it (the marker
# covers them); `restore(step, like)` hands them back in the meta under this key.
AHEAD = "ahead"


class UnreadableCheckpointError(StorageError):
    """A finalised checkpoint that cannot be restored: its files are truncated, missing or not
    what Orbax wrote. The message names the folder and the first line of what the reader said
    (TensorStore's own errors run to pages of JSON spec)."""

    def __init__(self, step: int, uri: str, reason: str):
        self.step, self.uri, self.reason = step, uri, reason
        super().__init__(f"checkpoint {step} at {uri} could not be restored: {reason}")


@dataclasses.dataclass(frozen=True)
class SetAside:
    """A checkpoint that failed to restore while resuming, and where it was moved."""

    step: int
    uri: str  # the folder it was
    moved_to: str | None  # the folder it is now, files intact (None: it was gone before it could be moved)
    error: str  # UnreadableCheckpointError's message: names the folder and the first line of the cause
    reason: str  # that first line alone
    next_step: int | None  # the next older finalised checkpoint, tried next; None: none is left

    @property
    def message(self) -> str:
        then = (
            f"falling back to checkpoint {self.next_step}"
            if self.next_step is not None
            else "no older checkpoint is left: training starts again from step 0"
        )
        where = f"set aside as {self.moved_to}" if self.moved_to else "it is no longer there"
        return f"checkpoint {self.step} at {self.uri} could not be restored ({self.reason}): {where}; {then}"

    def as_event(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "message": self.message}


# errno -> what a user reads when a checkpoint cannot be written (Checkpointer._writable)
_WRITE_FAULTS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "not permitted (an immutable or locked folder)",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "the disk quota is exceeded",
}


class Checkpointer:
    def __init__(
        self,
        directory: str,
        max_to_keep: int | None = 3,
        async_save: bool = True,
        keep_steps: Sequence[int] = (),
        cleanup_tmp: bool = False,
    ):
        """`max_to_keep` newest checkpoints are kept (None: all), and those of `keep_steps` (each
        epoch's last, so that it can be evaluated or exported later) whatever their age.
        `cleanup_tmp`: delete the unfinished saves (`{step}.orbax-checkpoint-tmp`) a killed writer
        left; only the run's one writer may (a reader beside it would delete its save in flight)."""
        self.directory = directory
        if max_to_keep is not None and keep_steps:
            policy = ocp.checkpoint_managers.AnyPreservationPolicy(
                [ocp.checkpoint_managers.LatestN(n=max_to_keep), ocp.checkpoint_managers.CustomSteps(list(keep_steps))]
            )
            opts = ocp.CheckpointManagerOptions(
                preservation_policy=policy,
                enable_async_checkpointing=async_save,
                create=True,
                cleanup_tmp_directories=cleanup_tmp,
            )
        else:
            opts = ocp.CheckpointManagerOptions(
                max_to_keep=max_to_keep,
                enable_async_checkpointing=async_save,
                create=True,
                cleanup_tmp_directories=cleanup_tmp,
            )
        handlers = {
            "state": ocp.StandardCheckpointHandler(),
            "meta": ocp.JsonCheckpointHandler(),
            AHEAD: ocp.StandardCheckpointHandler(),
            f"{AHEAD}_record": ocp.JsonCheckpointHandler(),
        }
        self._mngr = ocp.CheckpointManager(directory, options=opts, item_handlers=handlers)
        if cleanup_tmp:  # Orbax deletes them in a thread of its own, awaited only by a save: wait now
            getattr(self._mngr, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    def uri(self, step: int) -> str:
        """The folder of checkpoint `step` (Orbax's default step name: the number itself)."""
        return posixpath.join(self.directory.rstrip("/"), str(step))

    def save(self, step: int, state: Any, meta: dict[str, Any], ahead: tuple[Any, dict] | None = None) -> None:
        """Start saving `state` as checkpoint `step` (the number of steps done), and `ahead`, an
        asynchronous run's batches drawn but not yet trained ((numpy arrays, JSON record)). StorageError
        when the folder no longer takes writes (this save's, or the one before it, which Orbax waits for)."""
        items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta, step=step)))
        if ahead is not None:
            items.update({AHEAD: ocp.args.StandardSave(ahead[0]), f"{AHEAD}_record": ocp.args.JsonSave(ahead[1])})
        with self._writable(step):
            self._mngr.save(step, args=ocp.args.Composite(**items))
        self._saving = step

    def wait(self) -> None:
        """Block until the last save is durable; StorageError naming it when it could not be written."""
        with self._writable(getattr(self, "_saving", None)):
            self._mngr.wait_until_finished()

    @contextlib.contextmanager
    def _writable(self, step: int | None):
        """An OSError of a folder that stopped taking writes (permission denied, an immutable or
        read-only folder, no space or quota) as LastingStorageError (exit 11, not retried) naming
        the checkpoint and the cause.
        Orbax's own threads of that save then wait minutes on signals that never come, so the
        worker exits without joining them (grpo_core.stages.worker)."""
        try:
            yield
        except OSError as exc:
            cause = _WRITE_FAULTS.get(exc.errno)
            if cause is None:
                raise
            where = self.uri(step) if step is not None else self.directory
            raise LastingStorageError(
                f"cannot write checkpoint {step if step is not None else ''} at {where}: {cause} "
                f"({exc.strerror}: {exc.filename or where})"
            ) from exc

    # Which steps count as finished is Orbax's rule here, the manager's that restores and prunes
    # them (its step-name format; no temporary name; on gs:// also its commit_success.txt).
    # grpo_core.store.report.latest_checkpoint reads the folder names without JAX for status
    # and summaries: a second rule on purpose, see its docstring.
    def latest_step(self) -> int | None:
        """The newest finalised checkpoint, or None."""
        self._mngr.reload()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def restore(
        self, step: int, like: Any = None, only: str | None = None, layout: Callable[[Any], Any] | str | None = None
    ) -> tuple[Any, dict[str, Any]]:
        """Restore checkpoint `step` into the structure, shapes, dtypes and shardings of `like`
        (None: as saved, plain nested dicts of arrays on this process's first device, e.g. for
        inspection or export, whatever mesh and number of processes wrote it). `only` (with
        `like` None): read that entry of the state alone, e.g. "params" without the optimizer's
        moments (twice the parameters' bytes under Adam), for evaluation, export or a run that
        starts from this one; the state returned holds just that entry. `layout` (with `only`):
        the shardings of that entry's arrays, from its tree of jax.ShapeDtypeStructs (paths as
        saved: {only: ...}), each array read straight into its shards instead of whole onto one
        device (a model larger than one chip); or HOST: numpy arrays in this process's memory.

        Raises UnreadableCheckpointError naming the folder when its files cannot be read back;
        an allocation failure (the arrays do not fit) is raised as it is: the checkpoint is fine."""
        try:
            if like is None:
                here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
                saved = self._mngr.item_metadata(step)["state"]
                abstract = jax.tree.map(
                    lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here), getattr(saved, "tree", saved)
                )
                if only is not None:
                    part = {only: abstract[only]}
                    if layout == HOST:
                        part = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), part)
                    elif layout is not None:
                        part = jax.tree.map(
                            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), part, layout(part)
                        )
                    return self._restore_part(step, part), self._restore_meta(step)
            else:
                abstract = jax.tree.map(_abstract, like)
            items = dict(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
            if like is not None and AHEAD in self._mngr.item_metadata(step):  # a run that resumes reads them too
                items.update({AHEAD: ocp.args.StandardRestore(), f"{AHEAD}_record": ocp.args.JsonRestore()})
            out = self._mngr.restore(step, args=ocp.args.Composite(**items))
            meta = dict(out["meta"])
            if AHEAD in items:
                meta[AHEAD] = (out[AHEAD], dict(out[f"{AHEAD}_record"]))
            return out["state"], meta
        except Exception as exc:
            if is_out_of_memory(exc):
                raise
            # TensorStore, Orbax, the JSON reader and the pytree code each fail in their own way
            # on a damaged folder, so any failure to read it back is this one error, the cause
            # chained for the traceback.
            raise UnreadableCheckpointError(step, self.uri(step), self._diagnose(step, exc, like)) from exc

    def _restore_part(self, step: int, item: Any) -> Any:
        """The entries of the saved state that `item` (abstract arrays) names, the others never
        read: Orbax's partial restore over the state's folder, which StandardSave wrote in the
        PyTree format."""
        handler = ocp.PyTreeCheckpointHandler()
        try:
            restore_args = jax.tree.map(
                lambda a: (
                    ocp.RestoreArgs(restore_type=np.ndarray, dtype=a.dtype)
                    if a.sharding is None  # HOST
                    else ocp.ArrayRestoreArgs(sharding=a.sharding, global_shape=a.shape, dtype=a.dtype)
                ),
                item,
            )
            return handler.restore(
                epath.Path(self.uri(step)) / "state",
                args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
            )
        finally:
            handler.close()

    def _restore_meta(self, step: int) -> dict[str, Any]:
        out = self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(out["meta"])

    def _diagnose(self, step: int, exc: BaseException, like: Any) -> str:
        """The first line of why checkpoint `step` did not restore. Restoring into `like`, Orbax
        reports a missing or damaged state/_METADATA (the array metadata) as a "pytree structure
        error"; its metadata reader then answers None for the state (or raises), which says it
        plainly. Asked on the failure path only."""
        if like is not None:
            try:
                unreadable = self._mngr.item_metadata(step)["state"] is None
            except Exception as meta_exc:  # noqa: BLE001 - the better answer to why the restore failed
                return _first_line(meta_exc)
            if unreadable:
                return _trim(
                    f"its array metadata cannot be read (state/_METADATA missing or damaged); "
                    f"Orbax said: {_first_line(exc)}"
                )
        return _first_line(exc)

    def read_meta(self, step: int) -> dict[str, Any] | None:
        """Checkpoint `step`'s JSON record alone (seed, config hash, step); None if unreadable."""
        try:
            return dict(self._mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])
        except Exception:  # noqa: BLE001 - a record that cannot be read is answered by None
            return None

    def restore_newest(
        self,
        like: Any,
        check: Callable[[int, dict[str, Any]], None] | None = None,
        on_set_aside: Callable[[SetAside], None] | None = None,
    ) -> tuple[int, Any, dict[str, Any]] | None:
        """Restore the newest finalised checkpoint that can be restored, as (step, state, meta);
        None when there is none (or every one was set aside).

        A checkpoint that fails to restore (UnreadableCheckpointError) is moved to
        `_set_aside/{step}-{UTC time}/`, reported to `on_set_aside`, and the next older one is
        tried. `check(step, meta)` may raise to refuse a checkpoint (another run's): that error
        propagates and nothing is moved, also when the checkpoint is unreadable but its record
        says it is not this run's to touch.

        Multi-host: every process restores; if it failed on any process it counts as failed on
        all, process 0 alone moves the folder, and every process waits for the move before the
        next try, so all of them end on the same step. One process: no collective at all."""
        steps = self.all_steps()
        for i, step in reversed(list(enumerate(steps))):
            error: UnreadableCheckpointError | None = None
            try:
                state, meta = self.restore(step, like)
            except UnreadableCheckpointError as exc:
                error = exc
            failed_on = _failed_processes(error is not None)
            if not failed_on:
                if check is not None:
                    check(step, meta)
                return step, state, meta
            if error is None:  # this process read it; another did not (its own log says why)
                error = UnreadableCheckpointError(
                    step, self.uri(step), f"its files could not be read on process(es) {failed_on}"
                )
            log.warning("%s", error)
            if check is not None and (record := self.read_meta(step)) is not None:
                check(step, record)  # another run's checkpoint, damaged or not, is not ours to move
            moved_to = self._set_aside(step)
            aside = SetAside(
                step=step,
                uri=self.uri(step),
                moved_to=moved_to,
                error=str(error),
                reason=error.reason,
                next_step=steps[i - 1] if i > 0 else None,
            )
            log.warning("%s", aside.message)
            if on_set_aside is not None:
                on_set_aside(aside)
        return None

    def _set_aside(self, step: int) -> str | None:
        """Move checkpoint `step`'s folder to `_set_aside/{step}-{UTC time}/` (process 0 only;
        every process waits for it) and return the new folder's URI; None if it was gone already.
        (Another process names the folder from its own clock: only process 0's name is sure,
        and only process 0 reports.)"""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target: str | None = posixpath.join(self.directory.rstrip("/"), SET_ASIDE, f"{step}-{stamp}")
        if jax.process_index() == 0:
            fs, src = filesystem(self.uri(step))
            try:
                n, base = 1, target
                while fs.exists(filesystem(target)[1]):  # the same step set aside twice in a second
                    target, n = f"{base}.{n}", n + 1
                if fs.exists(src):
                    _move_folder(fs, src, filesystem(target)[1])
                else:  # removed since it was listed (by a user, or a process of another attempt)
                    log.warning("checkpoint %d at %s is no longer there: nothing to set aside", step, self.uri(step))
                    target = None
            except OSError as exc:  # the storage itself fails: a retry may help, so no fall-back now
                raise StorageError(
                    f"checkpoint {step} at {self.uri(step)} could not be restored and could not be set aside "
                    f"as {target}: {_first_line(exc)}"
                ) from exc
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"grpo-set-aside-{step}")
        self._mngr.reload()  # forget the step: a later save of the same number starts afresh
        return target

    def close(self) -> None:
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if isinstance(exc, StorageError):  # a save that could not be written: closing waits on it for minutes
            return
        self.close()


def _move_folder(fs, src: str, dst: str) -> None:
    """Move a folder whole. Locally a rename (atomic). On an object store a folder is a prefix:
    copy every object, then delete the originals, Orbax's commit_success.txt first, so that a
    move cut off half-way leaves a folder Orbax no longer takes for a finalised checkpoint, and
    the set-aside copy complete (fs.mv would do the same two steps, slowly on the emulator)."""
    local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
    if local:
        fs.makedirs(posixpath.dirname(dst), exist_ok=True)
        fs.mv(src, dst, recursive=True)
        return
    fs.copy(src.rstrip("/") + "/", dst, recursive=True)
    marker = posixpath.join(src, "commit_success.txt")
    if fs.exists(marker):
        fs.rm_file(marker)
    fs.rm(src, recursive=True)
    # Orbax lists gs:// through etils.epath's own gcsfs instance (other constructor arguments, so
    # another cached instance with its own listing cache): unless every instance forgets, Orbax
    # still lists the moved step, and a later save of that number fails as already there.
    for instance in [fs, *getattr(type(fs), "_cache", {}).values()]:
        instance.invalidate_cache()


def _failed_processes(failed: bool) -> list[int]:
    """The processes on which a restore failed: this one alone without a collective when it is
    the only one; otherwise every process's answer, so they all take the same branch."""
    if jax.process_count() == 1:
        return [0] if failed else []

    every = np.asarray(multihost_utils.process_allgather(np.asarray([int(failed)], np.int32)))
    return [int(i) for i in np.flatnonzero(every.reshape(-1))]


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an error, at most `limit` characters. TensorStore wraps a failed read in
    an error that is mostly its store's JSON spec ("See full TensorStore details: ..."); the error
    it wraps says what failed and where (the array, the file, the byte range), so that one is told."""
    while _TENSORSTORE_DUMP in str(exc) and exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip()
    line = text.splitlines()[0].strip() if text else ""
    for dump in (f" {_TENSORSTORE_DUMP}", " [tensorstore_spec="):  # the two ways it appends its spec
        line = line.split(dump, 1)[0]
    line = line.rstrip(" .") or type(exc).__name__
    if not line.startswith(type(exc).__name__) and type(exc).__name__ not in ("Exception", "ValueError"):
        line = f"{type(exc).__name__}: {line}"  # e.g. JSONDecodeError, FileNotFoundError: the kind says much
    return _trim(line, limit)


def _trim(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


_TENSORSTORE_DUMP = "See full TensorStore details"


def _abstract(x: Any):
    """What to restore `x` as: its shape and dtype, and for a jax.Array where it lives (shapes
    given as jax.ShapeDtypeStruct carry theirs)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return ocp.utils.to_shape_dtype_struct(x)
