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
  (comma-separated; `grpo serve --allow-field`) names the field.

A module name is checked as text and never imported to check it: importing a package runs its
`__init__`, which is the code being refused.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

from grpo_core.errors import ConfigError

ENV_PATHS = "GRPO_REWARD_PATHS"
ENV_MODULES = "GRPO_REWARD_MODULES"
ENV_FIELDS = "GRPO_ALLOW_FIELDS"
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
        )

    def reward_refusal(self, spec: str, cwd: str | None = None) -> str | None:
        """Why `spec` (a reward's `function`) may not run for a deployment, or None if it may."""
        from grpo_core.rewards.registry import builtin_rewards

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

    def check(self, cfg: Any, cwd: str | None = None) -> None:
        """ConfigError naming the first field of `cfg` (a RunConfig) that a deployment's config may not set."""
        for field, specs in (("rewards", cfg.rewards), ("eval.rewards", cfg.eval.rewards)):
            for i, spec in enumerate(specs):
                why = self.reward_refusal(spec.function, cwd)
                if why:
                    raise ConfigError(
                        f"{field}[{i}].function {spec.function!r} may not run in a deployment run: {why}. "
                        "A config from the API or the UI may name the built-in rewards and the reward files "
                        "and modules the operator allowed; " + HOW_TO_ALLOW.format(paths=ENV_PATHS, modules=ENV_MODULES)
                    )
        from grpo_core.config.run import RunConfig

        default = RunConfig.from_dict({})
        for field in PROGRAM_FIELDS:
            if field not in self.fields and _get(cfg, field) != _get(default, field):
                raise ConfigError(
                    f"{field}={_get(cfg, field)!r} may not be set in a deployment run: it names a program "
                    f"this machine would run. An operator allows it with `grpo serve --allow-field {field}` "
                    f"(or {ENV_FIELDS}={field} in the environment of the process that runs the flow)"
                )


def _get(cfg: Any, dotted: str) -> Any:
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _inside(path: str, allowed: str) -> bool:
    """Whether real path `path` is `allowed` (a file) or lies under it (a folder)."""
    try:
        return path == allowed or os.path.commonpath([path, allowed]) == allowed and os.path.isdir(allowed)
    except ValueError:  # paths on different drives
        return False


def _listed(items: tuple[str, ...]) -> str:
    return "allowed: " + ", ".join(items) if items else "none is allowed"
