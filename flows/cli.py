"""The `grpo` command line.

`grpo demo` trains the embedded default (tiny preset, synthetic reverse task) and shows the
reward rise; `grpo train` runs the same engine on a YAML config with `--set` overrides.
These drive the engine in this process; the Prefect pipeline will take over `grpo run`.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import yaml


def _load_config(path: str | None, overrides: list[str]) -> dict:
    from grpo_core.config import apply_overrides
    from grpo_core.recipes import SYNTHETIC_DEFAULT

    import copy

    cfg = copy.deepcopy(SYNTHETIC_DEFAULT)
    if path:
        loaded = yaml.safe_load(pathlib.Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise SystemExit(f"config file {path}: expected a mapping at the top level, got {type(loaded).__name__}")
        cfg = _merge(cfg, loaded)
    return apply_overrides(cfg, overrides)


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _row(m: dict) -> str:
    return (f"{int(m['step']):>6d} {m['reward']:>7.3f} {m.get('rewards/exact_match/mean', float('nan')):>6.3f} "
            f"{m['completions/mean_length']:>6.2f} {m['kl']:>7.4f} {m['entropy']:>6.3f} {m['grad_norm']:>6.2f} "
            f"{m['time/step'] * 1000:>7.1f}")


HEADER = f"{'step':>6} {'reward':>7} {'exact':>6} {'len':>6} {'kl':>7} {'entropy':>6} {'gnorm':>6} {'ms/step':>7}"


def train_command(args) -> int:
    from grpo_core.config import ConfigError
    from grpo_core.evaluation import complete, evaluate
    from grpo_core.recipes import build_synthetic
    from grpo_core.trainer import GRPOTrainer

    t_start = time.perf_counter()
    try:
        cfg = _load_config(args.config, args.set)
        run = build_synthetic(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    tr = GRPOTrainer(run.model, run.train, run.tokenizer, run.rewards, run.task)
    ev = lambda: evaluate(tr.graphdef, tr.params, run.tokenizer, run.eval_rows, run.eval_rewards, run.train.sampling)
    before = ev()
    shown = run.eval_rows[:4]
    [(_, before_texts)] = list(complete(tr.graphdef, tr.params, run.tokenizer, shown, run.train.sampling))
    print(f"model: {run.model.config.num_params():,} params; {run.train.num_steps} steps of "
          f"{run.train.grpo.prompts_per_step} prompts x {run.train.grpo.num_generations} completions")
    print(f"before training: greedy accuracy {before['exact_match']:.3f}, reward {before['char_match']:.3f} "
          f"on {len(run.eval_rows)} held-out prompts")
    print(HEADER)
    every = max(1, args.print_every)
    metrics_file = open(args.metrics, "w") if args.metrics else None
    history = []

    def on_step(m):
        history.append(m)
        if metrics_file:
            metrics_file.write(json.dumps(m) + "\n")
        if int(m["step"]) % every == 0 or int(m["step"]) == run.train.num_steps - 1:
            print(_row(m), flush=True)

    t_train = time.perf_counter()
    tr.train(on_step=on_step)
    train_s = time.perf_counter() - t_train
    if metrics_file:
        metrics_file.close()
    after = ev()
    window = max(1, len(history) // 20)
    first = sum(m["reward"] for m in history[:window]) / window
    last = sum(m["reward"] for m in history[-window:]) / window
    print(f"\ntraining reward (mean of {window} steps): {first:.3f} at the start -> {last:.3f} at the end")
    print(f"greedy accuracy on held-out prompts: {before['exact_match']:.3f} -> {after['exact_match']:.3f}")
    print(f"training {train_s:.1f} s ({1000 * train_s / len(history):.0f} ms/step), total {time.perf_counter() - t_start:.1f} s")
    [(_, after_texts)] = list(complete(tr.graphdef, tr.params, run.tokenizer, shown, run.train.sampling))
    print("held-out examples (greedy): prompt -> before training | after training | expected")
    for row, b, a in zip(shown, before_texts, after_texts):
        print(f"  {row['prompt']!r:>8} -> {b!r:>10} | {a!r:>8} | {row['answer']!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO post-training in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("demo", "train the embedded default and show the reward rise"),
                        ("train", "train on a config file with overrides")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--config", help="YAML file over the default config")
        p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                       help="override, e.g. --set train.grpo.beta=0.04 (repeatable)")
        p.add_argument("--print-every", type=int, default=50 if name == "demo" else 10)
        p.add_argument("--metrics", help="write per-step metrics as JSON lines to this file")
        p.set_defaults(func=train_command)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
