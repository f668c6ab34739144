"""Who may run what: the code a config may name, by where the config came from.

A config the local user gives (`grpo run`, `grpo check`, a YAML file, a direct call of the flow)
is that user's own: it may name any reward file or module (`path/to/file.py:fn`, `module:fn`)
and any program (`pipeline.worker_python`, `train.rollout.server_command`), which that user
could run anyway. A config that arrives as a deployment's parameters (the API, the UI's Run
form, a schedule) comes from whoever can reach the Prefect server, and runs on the operator's
machine, so it may name only what the operator allowed where the flow runs:

- the built-in rewards, by name;
- reward files under the folders (or the files) in GRPO_REWARD_PATHS (os.pathsep-separated;
  `grpo serve --allow-reward-path`); unset, the `rewards/` folder of the flow's working
  directory (the project's own), when there is one;
- reward modules named in GRPO_REWARD_MODULES (comma-separated; `grpo serve
  --allow-reward-module`): `pkg.rewards` allows `pkg.rewards:fn` and its submodules' functions,
  `pkg.rewards:fn` that one function. The standard library and installed packages are never
  rewards otherwise (`pty:spawn`, `subprocess:run`, `os:popen`, `builtins:exec` all have a
  signature a reward may have);
- the fields that start programs (PROGRAM_FIELDS) at their defaults, unless GRPO_ALLOW_FIELDS
  (comma-separated; `grpo serve --allow-field`) names the field;
- the places it writes and reads (PLACE_FIELDS: storage.root, the data files, model and tokenizer
  folders, an init_from folder or URL) as the deployment's own parameters set them, or under a
  root in GRPO_ALLOW_ROOTS (comma-separated folders or URLs; `grpo serve --allow-root`): a run
  from the UI writes into no other folder or bucket and reads no other file of the machine. Hub
  ids, the synthetic task and init_from run names (runs under storage.root) are not places.

A module name is checked as text and never imported to check it: importing a package runs its
`__init__`, which is the code being refused.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from grpo_core.config.run import RunConfig
from grpo_core.errors import ConfigError
from grpo_core.rewards.registry import builtin_rewards

ENV_PATHS = "GRPO_REWARD_PATHS"
ENV_MODULES = "GRPO_REWARD_MODULES"
ENV_FIELDS = "GRPO_ALLOW_FIELDS"
ENV_ROOTS = "GRPO_ALLOW_ROOTS"
DEFAULT_REWARD_DIR = "rewards"  # the project's reward folder, in the flow's working directory

# Fields whose value is a program to run (or the folder or interpreter it runs with): a
# deployment's config leaves them at their defaults unless the operator allows them by name.
PROGRAM_FIELDS = (
    "pipeline.worker_python",
    "pipeline.launcher.python",
    "pipeline.launcher.workdir",
    "train.rollout.server_command",
    "train.rollout.server_args",
)

# Fields that name a place the run writes (storage.root) or reads: a deployment's config keeps
# them as the deployment set them, or under a root the operator allowed.
PLACE_FIELDS = (
    "storage.root",
    "data.source",
    "data.eval_source",
    "model.path",
    "model.tokenizer",
    "model.init_from",
)
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")

HOW_TO_ALLOW = (
    "an operator allows reward files with `grpo serve --allow-reward-path DIR` (or {paths} in the "
    "environment of the process that runs the flow, e.g. a work-pool worker) and modules with "
    "`--allow-reward-module NAME` ({modules})"
)


@dataclasses.dataclass(frozen=True)
class TrustPolicy:
    """What a config from a deployment's parameters may name (see the module's doc)."""

    reward_paths: tuple[str, ...] = ()  # real absolute paths: folders, or single files
    reward_modules: tuple[str, ...] = ()  # "pkg.mod" (and its submodules) or "pkg.mod:fn"
    fields: tuple[str, ...] = ()  # PROGRAM_FIELDS a deployment's config may set
    roots: tuple[str, ...] = ()  # folders (real absolute paths) and URLs a deployment's places may lie under

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, cwd: str | None = None) -> "TrustPolicy":
        env = os.environ if environ is None else environ
        cwd = cwd or os.getcwd()
        if ENV_PATHS in env:
            paths = [p for p in env[ENV_PATHS].split(os.pathsep) if p.strip()]
        else:
            default = os.path.join(cwd, DEFAULT_REWARD_DIR)
            paths = [default] if os.path.isdir(default) else []
        split = lambda name: tuple(x.strip() for x in env.get(name, "").split(",") if x.strip())  # noqa: E731
        fields = split(ENV_FIELDS)
        unknown = [f for f in fields if f not in PROGRAM_FIELDS]
        if unknown:
            raise ConfigError(f"{ENV_FIELDS} names {unknown}, which are not among {list(PROGRAM_FIELDS)}")
        return cls(
            reward_paths=tuple(os.path.realpath(os.path.join(cwd, os.path.expanduser(p))) for p in paths),
            reward_modules=split(ENV_MODULES),
            fields=fields,
            roots=tuple(_place(r, cwd) for r in split(ENV_ROOTS)),
        )

    def reward_refusal(self, spec: str, cwd: str | None = None) -> str | None:
        """Why `spec` (a reward's `function`) may not run for a deployment, or None if it may."""
        if spec in builtin_rewards():
            return None
        if ":" not in spec:
            return None  # not code: make_rewards refuses it, naming the built-ins
        where, name = spec.rsplit(":", 1)
        if where.endswith(".py"):
            path = os.path.realpath(os.path.join(cwd or os.getcwd(), os.path.expanduser(where)))
            if any(_inside(path, allowed) for allowed in self.reward_paths):
                return None
            return f"the file {path} is not under an allowed reward folder ({_listed(self.reward_paths)})"
        if any(spec == m or (":" not in m and (where == m or where.startswith(m + "."))) for m in self.reward_modules):
            return None
        return f"the module {where!r} is not an allowed reward module ({_listed(self.reward_modules)})"

    def place_refusal(self, field: str, value: Any, baseline: Any = None, cwd: str | None = None) -> str | None:
        """Why `field`'s `value` (a place: see PLACE_FIELDS) may not be used by a deployment's
        config, or None if it may: as `baseline` (the deployment's own config) has it, not a place,
        or under an allowed root."""
        if value in (None, "") or (baseline is not None and value == _get(baseline, field)):
            return None
        if not _is_place(field, value):
            return None
        where = _place(value.split("@")[0] if field == "model.init_from" else value, cwd or os.getcwd())
        if any(_under(where, root) for root in self.roots):
            return None
        return f"{where} is not where this deployment's runs {'write' if field == 'storage.root' else 'read'} " + (
            f"({_listed(self.roots)})" if self.roots else "(no other root is allowed)"
        )

    def check(self, cfg: Any, cwd: str | None = None, baseline: Any = None) -> None:
        """ConfigError naming the first field of `cfg` (a RunConfig) that a deployment's config may
        not set; `baseline`: the deployment's own config, whose places are allowed."""
        for field, specs in (("rewards", cfg.rewards), ("eval.rewards", cfg.eval.rewards)):
            for i, spec in enumerate(specs):
                why = self.reward_refusal(spec.function, cwd)
                if why:
                    raise ConfigError(
                        f"{field}[{i}].function {spec.function!r} may not run in a deployment run: {why}. "
                        "A config from the API or the UI may name the built-in rewards and the reward files "
                        "and modules the operator allowed; " + HOW_TO_ALLOW.format(paths=ENV_PATHS, modules=ENV_MODULES)
                    )
        default = RunConfig.from_dict({})
        for field in PROGRAM_FIELDS:
            if field not in self.fields and _get(cfg, field) != _get(default, field):
                raise ConfigError(
                    f"{field}={_get(cfg, field)!r} may not be set in a deployment run: it names a program "
                    f"this machine would run. An operator allows it with `grpo serve --allow-field {field}` "
                    f"(or {ENV_FIELDS}={field} in the environment of the process that runs the flow)"
                )
        for field in PLACE_FIELDS:  # as the deployment has them (unknown: the default config's), or allowed
            why = self.place_refusal(field, _get(cfg, field), baseline or default, cwd)
            if why:
                raise ConfigError(
                    f"{field}={_get(cfg, field)!r} may not be set in a deployment run: {why}. An operator allows "
                    f"a folder or bucket prefix with `grpo serve --allow-root ROOT` (or {ENV_ROOTS}=ROOT,... in the "
                    "environment of the process that runs the flow, e.g. a work-pool worker)"
                )


def _get(cfg: Any, dotted: str) -> Any:
    if dotted == "storage.root":
        return cfg.storage_root
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _is_place(field: str, value: str) -> bool:
    """Whether a field's value names a folder, file or URL (not a Hub id, 'synthetic', a run name)."""
    if field == "storage.root" or "://" in value:
        return True
    if field == "model.init_from":
        ref = value.split("@")[0].strip("/")
        return "/" in ref or value.startswith((".", "~"))
    if value in ("synthetic", "char", "auto"):
        return False
    path = os.path.expanduser(value)
    return value.startswith(("/", ".", "~")) or value.endswith(_FILE_SUFFIXES) or os.path.exists(path)


def _place(value: str, cwd: str) -> str:
    """A URL without its trailing slash, or a local path made real and absolute."""
    if "://" in value:
        return value.rstrip("/")
    return os.path.realpath(os.path.join(cwd, os.path.expanduser(value)))


def _under(where: str, root: str) -> bool:
    if "://" in where or "://" in root:
        return where == root or where.startswith(root + "/")
    try:
        return os.path.commonpath([where, root]) == root
    except ValueError:
        return False


def _inside(path: str, allowed: str) -> bool:
    """Whether real path `path` is `allowed` (a file) or lies under it (a folder)."""
    try:
        return path == allowed or os.path.commonpath([path, allowed]) == allowed and os.path.isdir(allowed)
    except ValueError:  # paths on different drives
        return False


def _listed(items: tuple[str, ...]) -> str:
    return "allowed: " + ", ".join(items) if items else "none is allowed"
