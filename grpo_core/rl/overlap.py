"""Asynchronous rollouts (train.max_staleness = k): the batches of steps s+1 .. s+k are drawn while
step s updates. The batch of step s is drawn by the policy after exactly max(0, s - k) updates
(`version_of`: a fixed lag, prime-rl's async level, verl's one-step-off policy at k = 1), so a run is
deterministic and resumes to the same bytes; every batch carries the version that drew it, and no
batch more than k versions old is ever trained. k = 0 is the synchronous run: the same schedule
with no lag.

Where the rollout side runs (train.rollout.layout):
- colocated, k = 0 (`Inline`): in the learner's thread, between its updates, as a step always ran.
- colocated, k >= 1 (`Colocated`): a thread of the learner's process on the same devices, drawing
  with copies of the versions it needs (the learner donates its own arrays to each update).
- split, any k (grpo_core.rl.split.Split): a second local JAX process (grpo_core.stages.rollout) on CPU cores of its
  own, started and stopped with the stage, sent each version's weights over a socket.

The rollout side's loop is the same in the thread and the process (`RolloutSide`): batch j once
version max(0, j - k) is in hand. Each side counts its waits: the learner for a batch, the rollout
side for a version. Batches drawn but not yet trained at a checkpoint are saved in it (`to_saved`),
since they come from versions the checkpoint does not hold, and handed back on resume (`from_saved`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from typing import Any, Callable

import numpy as np

from grpo_core.generate.types import Completions
from grpo_core.rl.rollouts import Rollout, RolloutMaker

log = logging.getLogger(__name__)


def version_of(step: int, k: int) -> int:
    """The policy version (updates done) that draws the batch of `step` under max_staleness k."""
    return max(0, step - k)


@dataclasses.dataclass
class Made:
    """The batch of one step as the rollout side made it, stamped with the version that drew it."""

    step: int
    version: int
    rollout: Rollout
    info: dict[str, float]  # sampling_rounds, frac_reward_zero_std, rollout_tokens
    # the rollout side's seconds on it: rollout (the engine), rewards, score, and wait (for its version)
    seconds: dict[str, float]
    # (B, N) the drawing policy's log-probs in the learner's numerics, where the learner would rescore
    # the sampler's (RolloutConfig.learner_logprobs): scored by the side that holds that version
    behaviour_logp: np.ndarray | None = None


class Versions:
    """The policy versions the rollout side may still need, by version (thread-safe)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._held: dict[int, Any] = {}
        self._closed = False

    def put(self, version: int, params) -> None:
        with self._cv:
            self._held[version] = params
            self._cv.notify_all()

    def wait(self, version: int) -> tuple[Any, float]:
        """Version `version`'s parameters, and the seconds waited for them; older ones are dropped."""
        t = time.perf_counter()
        with self._cv:
            while version not in self._held and not self._closed:
                self._cv.wait(0.5)
            if self._closed:
                raise _ClosedError()
            for v in [v for v in self._held if v < version]:
                del self._held[v]
            return self._held[version], time.perf_counter() - t

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()


class _ClosedError(Exception):
    """The learner closed the rollout side."""


class Inbox:
    """The batches the rollout side made, by step, until the learner takes them; and the error
    that ended the rollout side, raised to the learner at its next wait (thread-safe)."""

    def __init__(self):
        self._cv = threading.Condition()
        self._made: dict[int, Made] = {}
        self._error: BaseException | None = None

    def put(self, made: Made) -> None:
        with self._cv:
            self._made[made.step] = made
            self._cv.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._cv.notify_all()

    def get(self, step: int, keep: bool = False) -> tuple[Made, float]:
        """The batch of `step` and the seconds waited for it; `keep`: leave it for a later get."""
        t = time.perf_counter()
        with self._cv:
            while step not in self._made and self._error is None:
                self._cv.wait(0.5)
            if step not in self._made:
                raise self._error
            made = self._made[step] if keep else self._made.pop(step)
            return made, time.perf_counter() - t


class RolloutSide:
    """The rollout side's loop: the batches of steps first .. end-1, each drawn once the version
    it needs is in hand, by `maker`, whose engine reads the parameters in `slot[0]`. `score`:
    (params, rollout) -> the drawing policy's log-probs in the learner's numerics, or None."""

    def __init__(self, maker: RolloutMaker, slot: list, k: int, score: Callable | None = None):
        self.maker, self.slot, self.k, self.score = maker, slot, k, score

    def run(self, first: int, end: int, versions: Versions, deliver: Callable[[Made], None]) -> None:
        for step in range(first, end):
            version = version_of(step, self.k)
            try:
                params, waited = versions.wait(version)
            except _ClosedError:
                return
            self.slot[0] = params
            self.maker.engine.sync(None, version)  # the built-in engine reads slot[0]: a record only
            self.maker.timers["rewards"] = 0.0
            t = time.perf_counter()
            ro, info = self.maker.rollout(step)
            drawn = time.perf_counter() - t
            behaviour = None if self.score is None else self.score(params, ro)
            seconds = {
                "rollout": drawn - self.maker.timers["rewards"],
                "rewards": self.maker.timers["rewards"],
                "score": time.perf_counter() - t - drawn,
                "wait": waited,
            }
            deliver(Made(step, version, ro, info, seconds, behaviour))


# -- the learner's side ----------------------------------------------------------------------------


class Inline:
    """k = 0, colocated: the step's batch drawn when the learner asks for it, by its current policy."""

    inline, started = True, True

    def __init__(self, maker: RolloutMaker):
        self.maker = maker

    def start(self, step: int, params, held: list[Made], end: int) -> None:
        pass

    def take(self, step: int) -> tuple[Made, float]:
        ro, info = self.maker.rollout(step)
        return Made(step, step, ro, info, {}), 0.0

    def publish(self, version: int, params) -> None:
        pass

    def ahead(self, step: int) -> list[Made]:
        return []

    def close(self) -> None:
        pass


class _Ahead:
    """What the thread and the process share on the learner's side: batches arrive in an Inbox,
    the ones a checkpoint must keep are read back from it, and `end` bounds the steps drawn."""

    inline = False

    def __init__(self, k: int):
        self.k, self.end, self.inbox, self.started = k, 0, Inbox(), False

    def promised(self, step: int) -> list[int]:
        """The steps from `step` on whose batches versions before `step` draw: a checkpoint at `step`
        must keep them (none at step 0, whose first k batches version 0 draws)."""
        return [s for s in range(step, min(step + self.k, self.end)) if version_of(s, self.k) < step]

    def first_to_draw(self, step: int, held: list[Made], end: int) -> int:
        """The first step to draw after the `held` batches, which must be the promised ones."""
        self.end = end
        want, got = self.promised(step), [m.step for m in held]
        if got != want:
            raise ValueError(
                f"the checkpoint at step {step} holds the batches drawn ahead of steps {got}, but "
                f"train.max_staleness={self.k} needs those of steps {want}"
            )
        for m in held:
            self.inbox.put(m)
        return step + len(held)

    def take(self, step: int) -> tuple[Made, float]:
        return self.inbox.get(step)

    def ahead(self, step: int) -> list[Made]:
        """The promised batches from `step` on (drawn by versions before it), waiting for any in flight."""
        return [self.inbox.get(s, keep=True)[0] for s in self.promised(step)]


class Colocated(_Ahead):
    """k >= 1 in the learner's process: a thread draws ahead with copies of the versions
    (`snapshot`: the learner's parameters copied, since each update donates them)."""

    def __init__(self, maker: RolloutMaker, slot: list, k: int, snapshot: Callable, score=None):
        super().__init__(k)
        self.side, self.snapshot, self.versions = RolloutSide(maker, slot, k, score), snapshot, Versions()

    def start(self, step: int, params, held: list[Made], end: int) -> None:
        first = self.first_to_draw(step, held, end)
        self.versions.put(step, self.snapshot(params))
        self.started = True
        threading.Thread(target=self._run, args=(first,), daemon=True, name="rollout-ahead").start()

    def _run(self, first: int) -> None:
        try:
            self.side.run(first, self.end, self.versions, self.inbox.put)
        except BaseException as exc:  # noqa: BLE001 - raised to the learner at its next take
            self.inbox.fail(exc)

    def publish(self, version: int, params) -> None:
        if version < self.end:  # a version no batch needs is not copied
            self.versions.put(version, self.snapshot(params))

    def close(self) -> None:
        self.versions.close()  # the thread ends at its next wait (a rollout in flight runs out first)


# -- batches kept in a checkpoint ------------------------------------------------------------------

_COMPLETION_FIELDS = ("tokens", "logprobs", "lengths", "truncated", "trained")


def to_saved(batches: list[Made]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Batches as a checkpoint holds them: (numpy arrays, JSON), by step; exact (the arrays as
    they are, the JSON floats round-trip), so a resumed run trains them to the same bytes."""
    arrays: dict[str, Any] = {}
    record: dict[str, Any] = {"steps": [m.step for m in batches], "batches": {}}
    for m in batches:
        ro, c = m.rollout, m.rollout.completions
        a = {f: np.asarray(getattr(c, f)) for f in _COMPLETION_FIELDS if getattr(c, f) is not None}
        a.update(prompt_tokens=ro.prompt_tokens, prompt_valid=ro.prompt_valid, rewards=ro.rewards)
        per = list(ro.per_function)  # names in order: array names are keys of a checkpoint's folders
        a.update({f"per_function_{i}": ro.per_function[k] for i, k in enumerate(per)})
        episode = None if ro.episode is None else list(ro.episode)
        a.update({f"episode_{i}": ro.episode[k] for i, k in enumerate(episode or [])})
        if m.behaviour_logp is not None:
            a["behaviour_logp"] = np.asarray(m.behaviour_logp)
        arrays[str(m.step)] = a
        record["batches"][str(m.step)] = {
            "version": m.version,
            "info": m.info,
            "seconds": m.seconds,
            "per_function": per,
            "episode": episode,
            "tool_seconds": ro.tool_seconds,
            "rows": json.loads(json.dumps(ro.rows, default=str)),
            "texts": ro.texts,
        }
    return arrays, record


def from_saved(arrays: dict[str, Any], record: dict[str, Any]) -> list[Made]:
    out = []
    for step in record["steps"]:
        a, r = arrays[str(step)], record["batches"][str(step)]
        c = Completions(**{f: a[f] if f in a else None for f in _COMPLETION_FIELDS})
        ro = Rollout(
            rows=r["rows"],
            prompt_tokens=a["prompt_tokens"],
            prompt_valid=a["prompt_valid"],
            completions=c,
            texts=r["texts"],
            rewards=a["rewards"],
            per_function={k: a[f"per_function_{i}"] for i, k in enumerate(r["per_function"])},
            episode=None if r["episode"] is None else {k: a[f"episode_{i}"] for i, k in enumerate(r["episode"])},
            tool_seconds=r["tool_seconds"],
        )
        out.append(Made(int(step), r["version"], ro, dict(r["info"]), dict(r["seconds"]), a.get("behaviour_logp")))
    return out
