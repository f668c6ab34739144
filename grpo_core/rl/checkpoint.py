"""Checkpoints of a training run with Orbax: everything needed to continue exactly.

A checkpoint holds the train state (parameters, optimizer state, update count) and a small
JSON record: the next step to run, the seed and the config hash. Prompts and PRNG keys are pure
functions of (seed, step), so the step *is* the position in the data and the PRNG state.

Orbax writes each checkpoint to a temporary name and finalises it last, and `latest_step`
only sees finalised ones: a save cut off half-way is never restored. Saves are asynchronous;
`wait()` blocks until the last one is durable. Orbax addresses local folders and `gs://`
(TensorStore) alike; the tests here cover local folders, and the pipeline's tests run it
against a GCS emulator.

Sharded and multi-host: every process calls save and restore (Orbax coordinates them; each
writes and reads its own shards). `restore(step, like)` lays the arrays out as `like`'s are,
so a run resumes on another mesh or another number of hosts; `restore(step)` gives every
process whole arrays on its own first device, whatever mesh wrote them (evaluation, export).
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: str, max_to_keep: int | None = 3, async_save: bool = True):
        self.directory = directory
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save, create=True)
        handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
        self._mngr = ocp.CheckpointManager(directory, options=opts, item_handlers=handlers)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start saving `state` as checkpoint `step` (the number of steps done)."""
        self._mngr.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta, step=step))),
        )

    def wait(self) -> None:
        self._mngr.wait_until_finished()

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

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict[str, Any]]:
        """Restore checkpoint `step` into the structure, shapes, dtypes and shardings of `like`
        (None: as saved, plain nested dicts of arrays on this process's first device, e.g. for
        inspection or export, whatever mesh and number of processes wrote it)."""
        if like is None:
            here = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            saved = self._mngr.item_metadata(step)["state"]
            abstract = jax.tree.map(
                lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=here), getattr(saved, "tree", saved)
            )
        else:
            abstract = jax.tree.map(_abstract, like)
        out = self._mngr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
        )
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _abstract(x: Any):
    """What to restore `x` as: its shape and dtype, and for a jax.Array where it lives."""
    if isinstance(x, jax.Array) and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return ocp.utils.to_shape_dtype_struct(x)
