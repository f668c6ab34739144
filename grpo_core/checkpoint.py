"""Checkpoints of a training run with Orbax: everything needed to continue exactly.

A checkpoint holds the train state (parameters, optimizer state, update count) and a small
JSON record: the next step to run, the seed and the config hash. Prompts and PRNG keys are pure
functions of (seed, step), so the step *is* the position in the data and the PRNG state.

Orbax writes each checkpoint to a temporary name and finalises it last, and `latest_step`
only sees finalised ones: a save cut off half-way is never restored. Saves are asynchronous;
`wait()` blocks until the last one is durable. Orbax addresses local folders and `gs://`
(TensorStore) alike; the tests here cover local folders, and the pipeline's tests run it
against a GCS emulator.
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
        opts = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=async_save,
                                            create=True)
        self._mngr = ocp.CheckpointManager(directory, options=opts)

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        """Start saving `state` as checkpoint `step` (the number of steps done)."""
        self._mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(dict(meta, step=step))))

    def wait(self) -> None:
        self._mngr.wait_until_finished()

    def latest_step(self) -> int | None:
        """The newest finalised checkpoint, or None."""
        self._mngr.reload()
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def restore(self, step: int, like: Any = None) -> tuple[Any, dict[str, Any]]:
        """Restore checkpoint `step` into the structure, shapes and dtypes of `like` (None: as
        saved, plain nested dicts of arrays, e.g. for inspection or export)."""
        abstract = None if like is None else jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                               meta=ocp.args.JsonRestore()))
        return out["state"], dict(out["meta"])

    def close(self) -> None:
        self._mngr.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
