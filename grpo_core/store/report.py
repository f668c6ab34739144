"""What a run root says about its run: where it stands (`status`), its summary.json and its
reward/accuracy curve. Reads storage only; imports neither JAX nor Prefect."""

from __future__ import annotations

import io
import math
from typing import Any

from grpo_core.config.run import StartPoint
from grpo_core.store.root import RunRoot

SUMMARY_KEYS = (
    "status",
    "steps",
    "reward_mean_first",
    "reward_mean_last",
    "eval_before",
    "eval_after",
    "checkpoint_uri",
    "export_uri",
)


EPISODE_KEYS = ("turns_per_episode", "tool_calls_per_episode", "tool_errors_per_episode")


def _nan_for_null(scores: Any) -> Any:
    return {k: math.nan if v is None else v for k, v in scores.items()} if isinstance(scores, dict) else scores


def read_eval(root: RunRoot, rel: str) -> dict[str, Any]:
    """One eval/{step}.json. Its scores (accuracy, pass@k, the greedy and sampled reward means)
    are floats, and a NaN among them (a mean over no scored row) is stored as null, strict JSON:
    it reads back as NaN, the float every reader formats."""
    result = root.read_json(rel)
    for k in [k for k in result if k == "accuracy" or k.startswith("pass@")]:
        result[k] = math.nan if result[k] is None else result[k]
    for k in ("greedy", "sampled"):
        if k in result:
            result[k] = _nan_for_null(result[k])
    return result


def eval_results(root: RunRoot) -> list[dict[str, Any]]:
    """eval/{step}.json of every evaluated step, by step."""
    out = []
    for name in root.list("eval"):
        if name.endswith(".json") and name[:-5].isdigit():
            out.append(read_eval(root, f"eval/{name}"))
    return sorted(out, key=lambda r: r["step"])


def _headline(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if result is None:
        return None
    keep = {k: v for k, v in result.items() if k == "accuracy" or k.startswith("pass@")}
    # episodes (train.agent): the greedy episodes' turns, tool calls and tool errors, per episode
    agent = {k: result["greedy"][k] for k in EPISODE_KEYS if k in result["greedy"]}
    return {"step": result["step"], **keep, "reward_mean": result["greedy"]["reward_mean"], **agent}


def window_means(rewards: list[float]) -> tuple[float | None, float | None]:
    """Mean training reward over the first and the last tenth of the steps (at least one step),
    over the steps that had a reward (a step no reward scored has NaN); None for a window with none."""
    if not rewards:
        return None, None
    w = max(1, len(rewards) // 10)

    def mean(xs: list[float]) -> float | None:
        xs = [x for x in xs if math.isfinite(x)]
        return sum(xs) / len(xs) if xs else None

    return mean(rewards[:w]), mean(rewards[-w:])


def _step_folders(root: RunRoot, folder: str) -> list[int]:
    """The all-digit folder names under `folder`, ascending: a save in progress has a temporary
    name, and checkpoints set aside sit under checkpoints/_set_aside/."""
    return sorted(int(n) for n in root.list(folder) if n.isdigit())


def latest_checkpoint(root: RunRoot) -> int | None:
    """The newest finalised checkpoint step, read from the folder names Orbax finalises
    (a checkpoint still being written has a temporary name).

    A second rule on purpose: grpo_core.rl.checkpoint.Checkpointer (what training resumes from)
    asks the Orbax manager that also restores and prunes them, which needs JAX and whose test
    depends on the storage (a renamed temporary folder on local disk; on gs:// the step's own
    folder plus its commit_success.txt marker); this JAX-free reading of the names serves status
    and summaries in the Prefect process. The two agree on local folders; on gs:// a save cut off
    before its marker counts here and not there (checkpoint_steps below counts it nowhere).

    Only all-digit names count: checkpoints that failed to restore when training resumed sit
    under checkpoints/_set_aside/ (grpo_core.rl.checkpoint.SET_ASIDE) and are never the latest."""
    steps = _step_folders(root, "checkpoints")
    return steps[-1] if steps else None


def checkpoint_steps(root: RunRoot) -> list[int]:
    """Every finalised checkpoint, as Orbax restores them, without JAX: on object stores (no
    atomic rename) the step's folder also holds Orbax's commit_success.txt once finalised."""
    steps = _step_folders(root, "checkpoints")
    if root.is_local:
        return steps
    return [s for s in steps if root.exists(f"checkpoints/{s}/commit_success.txt")]


def export_steps(root: RunRoot) -> list[int]:
    """The complete Hugging Face exports, export/{step}/ with its marker, ascending."""
    return [s for s in _step_folders(root, "export") if root.is_done(f"export/{s}")]


def latest_export(root: RunRoot) -> str | None:
    """The newest complete Hugging Face export."""
    steps = export_steps(root)
    return root.uri("export", str(steps[-1])) if steps else None


def build_summary(root: RunRoot, status: str, **extra: Any) -> dict[str, Any]:
    metrics = root.read_metrics()
    first, last = window_means([float(m["reward"]) for m in metrics])
    evals = eval_results(root)
    ckpt = latest_checkpoint(root)
    summary = {
        "status": status,
        # a damaged metrics tail (left out, with a warning) does not hide steps a checkpoint holds
        "steps": max(int(metrics[-1]["step"]) + 1 if metrics else 0, ckpt or 0),
        "reward_mean_first": first,
        "reward_mean_last": last,
        "eval_before": _headline(next((e for e in evals if e["step"] == 0), None)),
        "eval_after": _headline(evals[-1] if evals and evals[-1]["step"] > 0 else None),
        "checkpoint_uri": root.uri("checkpoints", str(ckpt)) if ckpt is not None else None,
        "export_uri": latest_export(root),
        "run_uri": root.url,
    }
    gaps = metric_gaps([int(m["step"]) for m in metrics], summary["steps"])
    if gaps:  # steps trained whose metrics rows are gone (a wiped bucket, a damaged shard): said, not hidden
        summary["metrics_missing"] = gaps
    start = started_from(root)
    if start is not None:
        summary["started_from"] = start
    summary.update(extra)
    return summary


def metric_gaps(steps: list[int], total: int) -> list[str]:
    """The steps of 0..total-1 that have no metrics row, as ranges ('0-59', '120')."""
    have, out, start = set(steps), [], None
    for s in range(total + 1):
        missing = s < total and s not in have
        if missing and start is None:
            start = s
        elif not missing and start is not None:
            out.append(f"{start}-{s - 1}" if s - 1 > start else str(start))
            start = None
    return out


def started_from(root: RunRoot) -> dict[str, Any] | None:
    """The run and step a continual run started from (model.init_from), as config.json records it."""
    version = (
        (root.read_json("config.json").get("versions") or {}).get("model.init_from")
        if root.exists("config.json")
        else None
    )
    if not version:
        return None
    start = StartPoint.parse(version)
    return None if start is None else start.describe()


def plot_curve(root: RunRoot) -> bytes | None:
    """PNG: training reward per step (and its moving average) above eval accuracy and pass@k."""
    metrics, evals = root.read_metrics(), eval_results(root)
    if not metrics and not evals:
        return None
    import matplotlib  # heavy (~1 s): only the summary's curve needs it

    matplotlib.use("Agg")  # no display: render to bytes
    import matplotlib.pyplot as plt  # heavy, as matplotlib; after matplotlib.use

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    steps = [int(m["step"]) + 1 for m in metrics]  # steps done after it, as the evaluations below count them
    rewards = [float(m["reward"]) for m in metrics]
    top.plot(steps, rewards, lw=0.6, alpha=0.4, label="reward")
    w = max(1, len(rewards) // 20)
    smooth = [
        sum(rewards[max(0, i - w + 1) : i + 1]) / len(rewards[max(0, i - w + 1) : i + 1]) for i in range(len(rewards))
    ]
    top.plot(steps, smooth, lw=1.8, label=f"reward ({w}-step mean)")
    top.set_ylabel("training reward")
    top.legend(loc="lower right")
    top.grid(alpha=0.3)
    es = [e["step"] for e in evals]
    bottom.plot(es, [e["accuracy"] for e in evals], "o-", label="greedy accuracy")
    for k in sorted({k for e in evals for k in e if k.startswith("pass@")}, key=lambda k: int(k[5:])):
        bottom.plot(es, [e.get(k) for e in evals], "s--", label=k)
    bottom.set_xlabel("step")
    bottom.set_ylabel("eval")
    bottom.set_ylim(-0.02, 1.02)
    bottom.legend(loc="lower right")
    bottom.grid(alpha=0.3)
    fig.suptitle(root.url.rsplit("/", 1)[-1])
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def status(root: RunRoot) -> dict[str, Any]:
    """Where a run stands, from its run root alone."""
    if not root.exists("config.json"):
        raise FileNotFoundError(f"{root.url} is not a run: it has no config.json")
    cfg = root.read_json("config.json")
    stages = {name: root.done_info(f"stages/{name}") for name in root.list("stages") if root.is_done(f"stages/{name}")}
    metrics = root.read_metrics()
    done = int(metrics[-1]["step"]) + 1 if metrics else 0
    return {
        "run_uri": root.url,
        "num_steps": cfg["train"]["num_steps"],
        "steps_done": done,
        "latest_checkpoint": latest_checkpoint(root),
        "export_uri": latest_export(root),
        "stages_done": sorted(stages),
        "readiness": root.read_json("readiness.json").get("ready") if root.exists("readiness.json") else None,
        "eval": [_headline(e) for e in eval_results(root)],
        "summary": root.read_json("summary.json") if root.exists("summary.json") else None,
        # steps trained (up to the newest checkpoint or metrics row) whose metrics rows are gone
        "metrics_missing": metric_gaps([int(m["step"]) for m in metrics], max(done, latest_checkpoint(root) or 0)),
        # "step" counts steps as steps_done, checkpoints and evaluations do: the metrics files number
        # them from 0 (their step 3 is the 4th, after which checkpoint 4 is saved), and `grpo status`
        # printed "steps 4/4" beside "last step: step 3" (issue 53)
        "last_metrics": {"step": done, **{k: metrics[-1][k] for k in ("reward", "kl", "entropy") if k in metrics[-1]}}
        if metrics
        else None,
    }
