"""The readiness report: the run's tokenizer, data and storage checked here, the device checks in
a worker process (JAX initialises there, never in this process), and, given
pipeline.readiness.target, XLA's figures for the target compiled in a process of its own.

Prefect-free, so that `grpo check` starts in the time its checks take; the pipeline's
check-readiness task (tasks/stages.py) publishes the same report to Prefect.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
from typing import Any

from grpo_core.config import roofline
from grpo_core.config.launch import LauncherKind
from grpo_core.config.run import RunConfig
from grpo_core.config.train import RolloutEngineKind
from grpo_core.data.prepare import DataError, EncodeError, dry_run
from grpo_core.data.tokenizer import make_tokenizer
from grpo_core.errors import ConfigError
from grpo_core.launch.launchers import drop_ahead, start_ahead
from grpo_core.launch.processes import sglang_python
from grpo_core.launch.requests import request_for
from grpo_core.rewards.reward_model import ModelReward  # JAX-free: the weights load in the worker
from grpo_core.store.root import RunRoot, StorageError
from grpo_core.store.runs import check_run_root
from grpo_core.store.sources import model_config
from tasks.process import StageError, ahead_scope, run_worker


def readiness_report(
    cfg: RunConfig, timeout_s: float | None = None, data: bool = False, handover: bool = False, parity: bool = False
) -> dict[str, Any]:
    """The storage probe and the tokenizer (here), with `data` the prompts read and tokenized as
    the run will (`grpo check`: before any run; the pipeline prepares them just before), and the
    device checks (in a worker process), as one report. `handover` (the pipeline, whose training
    follows): with a local launcher the device checks run in the first training stage's worker,
    started ahead (grpo_core.stages.ahead), which is kept for that stage when the run is ready.
    `parity` (`grpo check`): each reward model's scores of a few texts against transformers', in a
    process of its own, where PyTorch is installed."""
    checks: list[dict[str, Any]] = []
    tokenizer = _tokenizer_check(cfg, checks)
    if tokenizer is None:  # the model's shape (its vocabulary) is not known: no device checks
        return {"checks": checks, "ready": False}
    if cfg.train.agent.enabled:  # the tools, and how this tokenizer's template writes their calls
        tokenizer = _agent_check(cfg, tokenizer, checks)
    if data:
        checks.append(_data_check(cfg, tokenizer))
    reward_models = _reward_model_checks(cfg, checks, parity, timeout_s or cfg.pipeline.check_timeout_s)
    try:
        RunRoot(cfg.run_url).probe()
        checks.append({"name": "storage", "ok": True, "detail": f"write/read/delete under {cfg.run_url}", "fix": None})
        checks.append(_run_check(cfg))
    except StorageError as exc:
        checks.append(
            {
                "name": "storage",
                "ok": False,
                "detail": str(exc),
                "fix": "check the bucket/folder exists and these credentials may write to it "
                "(GOOGLE_APPLICATION_CREDENTIALS or gcloud auth application-default login)",
            }
        )
    request = {
        "model": model_config(cfg, vocab_size=tokenizer.vocab_size).to_dict(),
        # num_steps still auto (data that cannot be prepared): the schedule's length changes no memory
        "train": cfg.train.replace(num_steps=1).to_dict() if cfg.train.num_steps == "auto" else cfg.train.to_dict(),
        "max_prompt_tokens": cfg.data.max_prompt_tokens,
        "require_tpu": cfg.pipeline.require_tpu,
        "rollout_engine": cfg.train.rollout.engine.value,
        "config_hash": cfg.train_hash,
        "lora": cfg.model.to_dict().get("lora"),
        "separate_reference": cfg.separate_reference,
        "run_root": cfg.run_url,
        **({"reward_models": [r.to_dict() for r in reward_models]} if reward_models else {}),
    }
    try:
        python = worker_python(cfg)
    except StageError as exc:  # reported as a failed check, with the device checks run here
        python = None
        checks.append({"name": "worker_python", "ok": False, "detail": str(exc), "fix": "make sglang-env"})
    timeout_s = timeout_s or cfg.pipeline.check_timeout_s
    launcher = cfg.pipeline.launcher
    if handover and python is not None and launcher.kind is LauncherKind.LOCAL:
        report = _checks_ahead(request, timeout_s, python, launcher)
    else:
        report = _device_checks(request, timeout_s, python, launcher)
    if "error" in report:  # the request itself was refused (exit 2): say why as a failed check
        checks.append({"name": "request", "ok": False, "detail": report["error"], "fix": "fix the config field named"})
    live = report.get("checks", [])
    if cfg.pipeline.readiness.target:  # XLA's figures for the target replace the formula's for this host
        aot = aot_report(cfg, tokenizer.vocab_size, timeout_s or cfg.pipeline.check_timeout_s)
        live = _with_target(report, live, aot)
        if aot.get("estimate") is not None:  # the compiler's step bound, for the run's steps and evaluations
            data_check = next((c for c in checks if c["name"] == "data"), None)
            report["estimate"] = _run_estimate(cfg, aot["estimate"], data_check, int(aot.get("devices") or 1))
    report["checks"] = checks + live
    report["ready"] = all(c["ok"] for c in report["checks"])
    if handover and not report["ready"]:
        drop_ahead(ahead_scope())  # no stage follows: the process that checked the devices ends
    return report


def aot_report(cfg: RunConfig, vocab_size: int, timeout_s: float) -> dict[str, Any]:
    """Compile the run's programs for pipeline.readiness.target in a process of its own (this
    one never imports JAX): XLA's report, or {"error": ...} saying why there is none. The process
    opens no TPU, so it may run beside a training worker on a TPU VM."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request_for(cfg, vocab_size), f)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "grpo_core.stages.aot", "--request", f.name],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        return {
            "error": f"compiling for {cfg.pipeline.readiness.target} took longer than {timeout_s:g} s "
            "(pipeline.check_timeout_s)"
        }
    finally:
        os.unlink(f.name)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"error": f"the AOT check exited with code {proc.returncode} without a report: {proc.stderr[-2000:]}"}


def _run_estimate(cfg: RunConfig, step: dict[str, Any], data: dict[str, Any] | None, devices: int) -> dict[str, Any]:
    """The compiler's step bound for the whole run (grpo_core.config.roofline): train.num_steps
    steps (auto: as the data read here makes it) and an evaluation of the eval rows at the start
    and after each of pipeline.epochs; `advice` what to try for a faster rollout on the target's
    `devices` chips."""
    read = data is not None and data["ok"]
    steps = cfg.train.num_steps
    if steps == "auto":
        steps = cfg.train.steps_for(data["train_rows"]) if read else None
    out = roofline.run(
        step,
        num_steps=steps,
        evaluations=cfg.pipeline.epochs + 1,
        eval_rows=data["eval_rows"] if read else None,
        batch_size=cfg.eval.batch_size,
        num_samples=cfg.eval.num_samples,
        new_tokens=cfg.train.sampling.max_new_tokens,
    )
    advice = roofline.rollout_advice(out, rollout_mesh_set=cfg.train.mesh.rollout is not None, devices=devices)
    out["advice"] = [advice] if advice else []
    return out


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def _with_target(report: dict[str, Any], live: list[dict[str, Any]], aot: dict[str, Any]) -> list[dict[str, Any]]:
    """The live checks with the target's: XLA's memory check instead of the formula's (kept as
    report["memory_formula"]), and whether the chips here are the target's."""
    report["target"] = aot
    if "error" in aot:
        fix = (
            "pip install -c constraints.txt '.[tpu-aot]'"
            if "libtpu" in aot["error"]
            else "raise pipeline.check_timeout_s (a cold check compiles every program)"
            if "pipeline.check_timeout_s" in aot["error"]
            else "fix pipeline.readiness.target or the field named"
        )
        return live + [{"name": "target", "ok": False, "detail": aot["error"], "fix": fix}]
    t, mem = aot["target"], aot["memory"]
    if "memory" in report:
        report["memory_formula"] = report["memory"]
    report["memory"] = dict(mem, remat=aot["remat"], grad_accum_steps=aot["grad_accum_steps"])
    out = [c for c in live if c["name"] != "memory"]
    chosen = " (chosen by the compiler)" if aot["auto"] else ""
    worst = next(p for p in aot["programs"] if p["program"] == mem["peak_program"])
    out.append(
        {
            "name": "memory",
            "ok": bool(mem["fits"]),
            "detail": f"XLA on {t['topology']}"
            + (f" x {t['num_slices']} slices" if t["num_slices"] > 1 else "")
            + f" ({t['chips']} x {t['device_kind']}, {_gib(t['hbm_bytes'])} HBM each; {aot['mesh']}): peak "
            f"{_gib(mem['peak_bytes'])} per chip in {mem['peak_program']} (XLA {_gib(worst['xla_peak_bytes'])} + "
            f"resident {_gib(worst['resident_bytes'])}) of {_gib(mem['usable_bytes'])} usable; train.remat="
            f"{aot['remat']}, train.grpo.grad_accum_steps={aot['grad_accum_steps']}{chosen}; "
            + (
                f"cached report ({aot['seconds']:.1f} s)"
                if aot.get("cached")
                else f"compiled in {aot['seconds']:.0f} s"
            ),
            "fix": aot.get("fix"),
        }
    )
    here = report.get("backend")
    if here == "tpu":
        same = report.get("device_kind") == t["device_kind"] and report.get("device_count") == t["chips"]
        detail = (
            f"{report.get('device_count')} x {report.get('device_kind')} here, target {t['chips']} x {t['device_kind']}"
        )
        fix = "run on the target's slice, or set pipeline.readiness.target to this slice's topology"
        out.append({"name": "target", "ok": same, "detail": detail, "fix": None if same else fix})
    else:
        out.append(
            {
                "name": "target",
                "ok": True,
                "detail": f"no TPU here ({here}): {t['topology']} checked by compiling for it",
                "fix": None,
            }
        )
    return out


def _tokenizer_check(cfg: RunConfig, checks: list[dict[str, Any]]):
    """The run's tokenizer (without train.agent's tools: _agent_check adds them), or None with a
    failed check naming model.tokenizer."""
    try:
        tokenizer = make_tokenizer(cfg, tools=False)
    except (ConfigError, StorageError) as exc:
        fix = "set model.tokenizer to a Hugging Face tokenizer: a Hub id, or a folder of what save_pretrained writes"
        checks.append({"name": "tokenizer", "ok": False, "detail": str(exc), "fix": fix})
        return None
    checks.append(
        {"name": "tokenizer", "ok": True, "detail": f"{cfg.tokenizer_id}, {tokenizer.vocab_size} tokens", "fix": None}
    )
    return tokenizer


def _run_check(cfg: RunConfig) -> dict[str, Any]:
    """What `grpo run` would say of the run folder: another config's run that trained there is
    refused (check_run_root, which the flow calls before any task), so the check says it too."""
    try:
        check_run_root(cfg)
    except ConfigError as exc:
        fix = "set run_name to a new name, or run_name: null to name the run by its config and inputs"
        return {"name": "run", "ok": False, "detail": str(exc), "fix": fix}
    return {"name": "run", "ok": True, "detail": f"{cfg.name}: the folder takes this config", "fix": None}


def _agent_check(cfg: RunConfig, tokenizer, checks: list[dict[str, Any]]):
    """train.agent: its tools and environment load, each with a schema, and the tokenizer's chat
    template writes calls in a format the episodes read; the tokenizer that renders the tools into
    the prompts (the data check reads them so), or the plain one with a failed check."""
    from grpo_core.agent.formats import detect  # the agent's checks: only a run with tools reads them
    from grpo_core.agent.tools import load_toolbox  # the agent's checks, as above
    from grpo_core.data.tokenizer import WithTools  # the agent's checks, as above

    agent = cfg.train.agent
    try:
        box = load_toolbox(agent)
        fmt = detect(tokenizer, agent.tool_format)
    except ConfigError as exc:
        fix = "fix the train.agent field or the file named (a tool's schema: its type hints and docstring)"
        checks.append({"name": "agent", "ok": False, "detail": str(exc), "fix": fix})
        return tokenizer
    env = f", environment {box.env_class.__name__} (one per episode)" if box.env_class is not None else ""
    detail = (
        f"tools {', '.join(box.names)}{env}; calls in the {fmt.value} format; episodes of at most "
        f"{agent.max_turns} turns and {agent.episode_tokens(cfg.train.sampling.max_new_tokens)} tokens after the "
        f"prompt, each turn re-reading the conversation through the {cfg.train.rollout.engine.value} engine"
    )
    checks.append({"name": "agent", "ok": True, "detail": detail, "fix": None})
    return WithTools(tokenizer, box.schemas) if hasattr(tokenizer, "apply_chat_template") else tokenizer


def _reward_model_checks(cfg: RunConfig, checks: list[dict[str, Any]], parity: bool, timeout_s: float) -> list:
    """One check per reward model (rewards[].model): what it is and how it scores, read from its
    config.json; with `parity`, a few scores against transformers'. The shapes the memory plan
    counts (grpo_core.config.memory.RewardModelShape) of those that load."""
    dtype, out, seen = cfg.compute_dtype.value, [], set()
    for field, spec in cfg.reward_models:
        key = (spec.model, spec.model_batch_size, spec.model_max_length)
        try:
            shape = ModelReward(spec, field).shape(dtype)
        except (ConfigError, StorageError) as exc:
            fix = f"set {field} to a one-label Qwen2, Qwen3 or Llama *ForSequenceClassification (a Hub id or a folder)"
            checks.append({"name": "reward_model", "ok": False, "detail": str(exc), "fix": fix})
            continue
        m = shape.config
        detail = (
            f"{field} {spec.name!r} ({spec.model}): {m.num_params() / 1e6:.1f} M parameters in {dtype}, "
            f"{m.num_hidden_layers} layers, on the reference's mesh; batches of {shape.batch_size} texts of at most "
            f"{shape.max_length} tokens (its own tokenizer and chat template), scores used as they are"
            + (f", clipped to {list(spec.clip)}" if spec.clip else "")
        )
        ok, fix = True, None
        if parity and key not in seen:
            said, ok = _parity(spec.model, field, timeout_s)
            detail += f"; {said}"
            fix = None if ok else "the scores differ from transformers': report it with the model's config.json"
        checks.append({"name": "reward_model", "ok": ok, "detail": detail, "fix": fix})
        if key not in seen:
            seen.add(key)
            out.append(shape)
    return out


def _parity(model: str, field: str, timeout_s: float) -> tuple[str, bool]:
    """(what the comparison with transformers found, in words; whether it agrees), from
    grpo_core.stages.reward_parity in a process of its own."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "grpo_core.stages.reward_parity", "--model", model, "--field", field],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        got = json.loads(proc.stdout.strip().splitlines()[-1])
    except subprocess.TimeoutExpired:
        return f"its scores were not compared with transformers' within {timeout_s:g} s", True
    except (json.JSONDecodeError, IndexError):
        return f"comparing its scores with transformers' failed: {proc.stderr[-300:]}", False
    if not got.get("torch"):
        return (
            "its scores were not compared with transformers' (PyTorch is not installed here: pip install torch)",
            True,
        )
    if "error" in got:
        return f"comparing its scores with transformers' failed: {got['error']}", False
    verdict = "agree" if got["ok"] else "DIFFER"
    return (
        f"scores of {got['texts']} texts ({min(got['tokens'])}-{max(got['tokens'])} tokens) here and in transformers "
        f"{verdict}: largest difference {got['max_abs_diff']:.2g} in float32",
        bool(got["ok"]),
    )


def _steps_said(cfg: RunConfig, rows: int) -> str:
    t = cfg.train
    steps = t.steps_for(rows) if t.num_steps == "auto" else t.num_steps
    how = (
        f"auto: {t.num_epochs:g} epochs"
        if t.num_steps == "auto"
        else f"{steps * t.grpo.prompts_per_step / rows:.2f} epochs"
    )
    return f"; train.num_steps {steps} x {t.grpo.prompts_per_step} prompts ({how} over them)"


def _data_check(cfg: RunConfig, tokenizer) -> dict[str, Any]:
    """The prompts read, rendered and tokenized as the run will, written nowhere."""
    try:
        got = dry_run(cfg.data, tokenizer)
    except EncodeError as exc:
        fix = "set model.tokenizer to one that covers the data"
        return {"name": "data", "ok": False, "detail": str(exc), "fix": fix}
    except (DataError, ConfigError, StorageError) as exc:
        return {"name": "data", "ok": False, "detail": str(exc), "fix": "fix the data.* field or the file named"}
    tokens = got["prompt_tokens"]
    detail = (
        f"{got['train_rows']} train / {got['eval_rows']} eval prompts from {cfg.data.source} ({got['format']}), "
        f"{tokens['min']}..{tokens['max']} tokens"
        + (f", {got['dropped_too_long']} over data.max_prompt_tokens dropped" if got["dropped_too_long"] else "")
        + _steps_said(cfg, got["train_rows"])
    )
    return {
        "name": "data",
        "ok": True,
        "detail": detail,
        "fix": None,
        "train_rows": got["train_rows"],
        "eval_rows": got["eval_rows"],
    }


def worker_python(cfg: RunConfig) -> str:
    """The interpreter of training workers (and of their readiness checks): pipeline.worker_python,
    else the sglang-jax environment when train.rollout.engine is sglang, else this one."""
    if cfg.pipeline.worker_python:
        return cfg.pipeline.worker_python
    if cfg.train.rollout.engine is RolloutEngineKind.SGLANG:
        python = sglang_python()
        if python is None:
            raise StageError(
                "train.rollout.engine=sglang runs the training worker in the sglang-jax environment "
                "(Python 3.12, its own jax/flax pins), which is not built: run `make sglang-env`, or set "
                "GRPO_SGLANG_PYTHON or pipeline.worker_python to its interpreter",
                retryable=False,
            )
        return python
    return sys.executable


def _checks_ahead(request: dict[str, Any], timeout_s: float, python: str, launcher) -> dict[str, Any]:
    """The device checks in the worker started ahead for the first training stage (launchers.
    start_ahead with the request as its first line): its report, read from its first output line
    within `timeout_s`. The process stays for the stage (grpo_core.stages.ahead ends it itself when
    not ready; readiness_report drops it when any check failed); a timeout or an exit without a
    report stops it."""
    scope = ahead_scope()
    proc = start_ahead(launcher, None, python, first={"readiness": request}, scope=scope)

    def read() -> None:  # up to the report: what follows is the stage's, which tasks.process reads
        while line := proc.stdout.readline():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue  # not the report (a library's print)
            if isinstance(event, dict) and event.get("event") == "report":
                reports.put(event["report"])
                return
        reports.put(None)

    reports: queue.Queue = queue.Queue()
    threading.Thread(target=read, daemon=True, name="readiness-ahead").start()
    try:
        report = reports.get(timeout=timeout_s)
    except queue.Empty:
        drop_ahead(scope)
        raise StageError(_CHECKS_TIMEOUT.format(timeout_s=timeout_s), retryable=True) from None
    if report is None:  # it ended without one
        code, err = proc.wait(), proc.stderr.read()
        drop_ahead(scope)
        raise StageError(_no_report(code, err), retryable=True)
    return report


_CHECKS_TIMEOUT = (
    "the device checks did not finish within {timeout_s:g} s (a TPU held by another process can block jax.devices())"
)


def _no_report(code: int, stderr: str) -> str:
    return f"the device checks exited with code {code} without a report: {stderr[-2000:]}"


def _device_checks(
    request: dict[str, Any], timeout_s: float, python: str | None = None, launcher=None
) -> dict[str, Any]:
    """Run grpo_core.stages.readiness in its own process (in the training workers' interpreter): it
    initialises JAX, which the Prefect process never does (a TPU belongs to the one process that
    opened it). With a multi-host launcher, on every host as training will run, the request
    passed inline (other hosts cannot read this machine's files); process 0 reports."""
    if launcher is not None and launcher.distributed:
        events = run_worker(
            ["grpo_core.stages.readiness", "--events", "--request-json", json.dumps(request)],
            timeout_s=timeout_s,
            on_event=lambda e: None,
            what="the device checks",
            python=python,
            launcher=launcher,
        )
        return next(e["report"] for e in events if e["event"] == "report")

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(request, f)
    try:
        proc = subprocess.run(
            [python or sys.executable, "-m", "grpo_core.stages.readiness", "--request", f.name],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        raise StageError(_CHECKS_TIMEOUT.format(timeout_s=timeout_s), retryable=True) from None
    finally:
        os.unlink(f.name)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        raise StageError(_no_report(proc.returncode, proc.stderr), retryable=True) from None


def readiness_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## Readiness: {'ready' if report['ready'] else 'NOT READY'}",
        "",
        f"{report.get('backend', '?')} · {report.get('device_kind', '?')} × {report.get('device_count', '?')} · "
        f"{report.get('process_count', '?')} process(es)",
        "",
        "| check | ok | detail | fix |",
        "|---|---|---|---|",
    ]
    for c in report["checks"]:
        cell = lambda s: str(s or "").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {c['name']} | {'yes' if c['ok'] else '**no**'} | {cell(c['detail'])} | {cell(c['fix'])} |")
    return "\n".join(lines)
