"""Who may run what: what a config may name, by where the config came from. It started with the
rewards (code a config names) and now holds every field that names something outside the run:
it lives beside the reward registry it checks names against (grpo_core.config is data only).

A config the local user gives (`grpo run`, `grpo check`, a YAML file, a direct call of the flow)
is that user's own: it may name any reward file or module, any program, place or address, and
ask for any amount of work, which that user could do anyway. A config that arrives as a
deployment's parameters (the API, the UI's Run form, a schedule) comes from whoever can reach the
Prefect server, and runs on the operator's machine, so every field that names something outside
the run obeys one policy, before any task runs. Each such field says what it names next to its
declaration (`field(..., trust=Trust.X)`, grpo_core.config.fields.Trust; `api_max=` for work):

- CODE (rewards[].function, eval.rewards): the built-in rewards by name; reward files under the
  folders (or the files) in GRPO_REWARD_PATHS (`grpo serve --allow-reward-path`; unset: the
  `rewards/` folder of the flow's working directory); reward modules named in
  GRPO_REWARD_MODULES (`--allow-reward-module`): `pkg.rewards` allows `pkg.rewards:fn` and its
  submodules' functions, `pkg.rewards:fn` that one function. The standard library and installed
  packages are never rewards otherwise (`pty:spawn`, `os:system` have a reward's signature). A
  module name is checked as text, never imported to check it (importing runs its `__init__`).
  A pickled reward (`….pkl:fn`, a notebook's callable: grpo_core.rewards.by_value) is never
  allowed: unpickling runs code, and nothing an operator sets allows it.
- PROGRAM (pipeline.worker_python, the launcher's python and workdir, the rollout server's
  command and arguments): at their defaults unless GRPO_ALLOW_FIELDS (`--allow-field`) names the
  field.
- READS and WRITES (storage.root, the data files, model and tokenizer folders, init_from,
  train.rollout.export_dir; the evaluate deployment's run_url): the default config's places, or
  under a root in GRPO_ALLOW_ROOTS (`--allow-root`; `grpo serve` adds its own config's places).
  Hub ids, the synthetic task and init_from run names are not places.
- ADDRESS (train.rollout.url, the Ray address, the TPU VM a launcher acts on): at their defaults,
  or a host in GRPO_ALLOW_HOSTS (`--allow-host HOST` or `HOST:PORT`), or a field named in
  GRPO_ALLOW_FIELDS.
- Work (`api_max`: rows, steps, epochs, processes, batch sizes, sample counts): at most the
  field's declared limit, or the operator's in GRPO_LIMITS (`--raise-limit FIELD=N`).

The anchor is the process that runs the flow: these variables are read from its environment, set
by the operator when `grpo serve` or a work-pool worker was started. Nothing a caller of the API
can change (a deployment's parameters, a PATCH of them) widens it; a flow run whose job
variables set one of them is refused (Prefect's process work pools pass job variables into the
flow run's environment). docs: the trust model.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from typing import Any, Iterator, Mapping
from urllib.parse import urlsplit

from grpo_core.agent.builtin import BUILTIN_ENVIRONMENTS, BUILTIN_TOOLS
from grpo_core.config.fields import Trust, api_max_of, section_type, trust_of
from grpo_core.config.run import DEFAULT_STORAGE_ROOT, RUN_TRUST, RewardSpec, RunConfig
from grpo_core.config.work import TOTALS
from grpo_core.errors import ConfigError
from grpo_core.rewards.by_value import is_pickled
from grpo_core.rewards.registry import builtin_rewards

ENV_PATHS = "GRPO_REWARD_PATHS"
ENV_MODULES = "GRPO_REWARD_MODULES"
ENV_FIELDS = "GRPO_ALLOW_FIELDS"
ENV_ROOTS = "GRPO_ALLOW_ROOTS"
ENV_HOSTS = "GRPO_ALLOW_HOSTS"
ENV_LIMITS = "GRPO_LIMITS"
TRUST_ENV = (ENV_PATHS, ENV_MODULES, ENV_FIELDS, ENV_ROOTS, ENV_HOSTS, ENV_LIMITS)
# Where the trackers of pipeline.report_to send or write (grpo_core.store.tracking): the operator's
# environment says it, never a run's job variables (refused_job_variables)
TRACKER_ENV = ("WANDB_BASE_URL", "WANDB_MODE", "WANDB_DIR", "MLFLOW_TRACKING_URI")
WANDB_DEFAULT_URL = "https://api.wandb.ai"
DEFAULT_REWARD_DIR = "rewards"  # the project's reward folder, in the flow's working directory
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")

# CODE fields checked through RunConfig.code with the rewards (built-ins by name, files, modules)
CODE_LISTED = ("train.agent.tools", "train.agent.environment")

HOW_TO_ALLOW = (
    "an operator allows reward files with `grpo serve --allow-reward-path DIR` (or {paths} in the "
    "environment of the process that runs the flow, e.g. a work-pool worker) and modules with "
    "`--allow-reward-module NAME` ({modules})"
)


@dataclasses.dataclass(frozen=True)
class Declared:
    """One field of the typed config as the policy sees it."""

    path: str  # dotted, rewards[].function for a list's items
    trust: Trust | None
    api_max: int | float | None
    hint: Any


def _walk(cls: type, prefix: str) -> Iterator[Declared]:
    for name, hint, f in cls.describe():
        sub = section_type(hint)
        if sub is not None:
            yield from _walk(sub, f"{prefix}{name}.")
        else:
            yield Declared(f"{prefix}{name}", trust_of(f), api_max_of(f), hint)


_REWARD_FIELDS = {f.name: f for f in dataclasses.fields(RewardSpec)}


@functools.lru_cache(maxsize=1)
def declared() -> tuple[Declared, ...]:
    """Every leaf field of the run config, in declaration order, with its trust class and limit."""
    hints = typing.get_type_hints(RunConfig)
    out = [Declared(p, t, None, str) for p, t in RUN_TRUST.items()]
    for section in ("model", "data", "train", "eval", "pipeline"):
        out += _walk(section_type(hints[section]), f"{section}.")
    out += _walk(RewardSpec, "rewards[].")
    return tuple(out)


def fields_of(*kinds: Trust) -> tuple[str, ...]:
    return tuple(d.path for d in declared() if d.trust in kinds)


def place_values(cfg: Any, *kinds: Trust) -> list[tuple[str, Any]]:
    """(field, value) of each place of `kinds` (READS, WRITES) `cfg` (a RunConfig) names: the
    fields of one value, and each reward model a rewards list names (rewards[i].model,
    eval.rewards[i].model), which a config holds as a list."""
    out = [(f, value_of(cfg, f)) for f in fields_of(*kinds) if "[]" not in f]
    if Trust.READS in kinds:
        out += [(field, spec.model) for field, spec in cfg.reward_models]
    return out


@dataclasses.dataclass(frozen=True)
class TrustPolicy:
    """What a config from a deployment's parameters may name (see the module's doc)."""

    reward_paths: tuple[str, ...] = ()  # real absolute paths: folders, or single files
    reward_modules: tuple[str, ...] = ()  # "pkg.mod" (and its submodules) or "pkg.mod:fn"
    fields: tuple[str, ...] = ()  # PROGRAM and ADDRESS fields a deployment's config may set
    roots: tuple[str, ...] = ()  # folders (real absolute paths) and URLs a deployment's places may lie under
    hosts: tuple[str, ...] = ()  # hosts (or host:port) a deployment's addresses may name
    limits: tuple[tuple[str, float], ...] = ()  # the operator's limits on work, over the declared ones
    trackers: tuple[tuple[str, str], ...] = ()  # TRACKER_ENV as the process that runs the flow has it

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
        return cls(
            reward_paths=tuple(os.path.realpath(os.path.join(cwd, os.path.expanduser(p))) for p in paths),
            reward_modules=split(ENV_MODULES),
            fields=check_allowed_fields(split(ENV_FIELDS), ENV_FIELDS),
            roots=tuple(_place(r, cwd) for r in split(ENV_ROOTS)),
            hosts=tuple(h.lower() for h in split(ENV_HOSTS)),
            limits=parse_limits(split(ENV_LIMITS), ENV_LIMITS),
            trackers=tuple((k, env[k]) for k in TRACKER_ENV if env.get(k)),
        )

    def reward_refusal(self, spec: str, cwd: str | None = None) -> str | None:
        """Why `spec` (a reward's `function`) may not run for a deployment, or None if it may."""
        if spec in builtin_rewards() or spec in BUILTIN_TOOLS or spec in BUILTIN_ENVIRONMENTS:
            return None
        if ":" not in spec:
            return None  # not code: make_rewards refuses it, naming the built-ins
        where, name = spec.rsplit(":", 1)
        if is_pickled(spec):  # code by value (flows.notebook): whatever the folder, no operator setting allows it
            return (
                "it names pickled code (a function or class pickled by value, from a notebook or a script), which "
                "runs only where it was pickled: a deployment never loads one. Put it in a file"
            )
        if where.endswith(".py"):
            path = os.path.realpath(os.path.join(cwd or os.getcwd(), os.path.expanduser(where)))
            if any(_inside(path, allowed) for allowed in self.reward_paths):
                return None
            return f"the file {path} is not under an allowed reward folder ({_listed(self.reward_paths)})"
        if any(spec == m or (":" not in m and (where == m or where.startswith(m + "."))) for m in self.reward_modules):
            return None
        return f"the module {where!r} is not an allowed reward module ({_listed(self.reward_modules)})"

    def place_refusal(self, field: str, value: Any, cwd: str | None = None) -> str | None:
        """Why `field`'s `value` (a READS or WRITES place) may not be used by a deployment's config,
        or None if it may: the default config's, not a place, or under an allowed root."""
        if value in (None, "") or ("[" not in field and value == value_of(_default(), field)):
            return None
        if not _is_place(field, value):
            return None
        cwd = cwd or os.getcwd()
        where = _place(value.split("@")[0] if field == "model.init_from" else value, cwd)
        if where == _place(DEFAULT_STORAGE_ROOT, cwd) or any(_under(where, root) for root in self.roots):
            return None
        verb = "write" if field in fields_of(Trust.WRITES) else "read"
        return f"{where} is not where this deployment's runs {verb} " + (
            f"({_listed(self.roots)})" if self.roots else "(no other root is allowed)"
        )

    def address_refusal(self, field: str, value: Any, storage_url: str | None = None) -> str | None:
        """Why `field`'s `value` (an ADDRESS) may not be used by a deployment's config, or None.
        `storage_url`: the run's, where a tracker of pipeline.report_to would keep a local store."""
        if field == "pipeline.report_to":
            allowed = field in self.fields  # the addresses are allowed; a store still needs a place
            return next((w for n in value or () if (w := self.tracker_refusal(n, storage_url, allowed))), None)
        if value in (None, "") or value == value_of(_default(), field) or field in self.fields:
            return None
        return self._host_refusal(value)

    def _host_refusal(self, value: str) -> str | None:
        host = _host(value)
        if host and any(h in (host[0], f"{host[0]}:{host[1]}") for h in self.hosts):
            return None
        if host:
            return f"the host {host[0]}{f':{host[1]}' if host[1] else ''} is not allowed ({_listed(self.hosts)})"
        return "it names a machine this run would act on"

    def tracker_refusal(self, name: str, storage_url: str | None = None, sends: bool = False) -> str | None:
        """Why tracker `name` of pipeline.report_to may not be used by a deployment's config, or
        None. TensorBoard writes its event files under the run root. W&B sends to its server
        (WANDB_BASE_URL, else api.wandb.ai) with the operator's key: an address, unless the
        operator's environment says WANDB_MODE offline or disabled (it then writes under the run
        root). MLflow sends to MLFLOW_TRACKING_URI where that names a server (an address); with
        none it keeps its store in the run root, so a run root that is not a local folder has
        nowhere for it. `sends`: the operator allowed the field (its trackers may send)."""
        env = dict(self.trackers)
        if name == "wandb" and not sends and env.get("WANDB_MODE", "").lower() not in ("offline", "disabled", "dryrun"):
            url = env.get("WANDB_BASE_URL", WANDB_DEFAULT_URL)
            why = self._host_refusal(url)
            return f"the tracker wandb sends the run's metrics to {url}: {why}" if why else None
        if name == "mlflow":
            uri = env.get("MLFLOW_TRACKING_URI", "")
            if "://" in uri and not uri.startswith(("file:", "sqlite:")):
                if sends:
                    return None
                why = self._host_refusal(uri)
                return f"the tracker mlflow sends the run's metrics to {uri}: {why}" if why else None
            if not uri and storage_url is not None and "://" in storage_url:
                return (
                    f"the tracker mlflow keeps its store in the run root, and {storage_url} is not a local folder "
                    "(the operator sets MLFLOW_TRACKING_URI where the flow runs)"
                )
        return None

    def limit(self, field: str, declared_max: float) -> float:
        return dict(self.limits).get(field, declared_max)

    def check(self, cfg: Any, cwd: str | None = None) -> None:
        """ConfigError naming every field of `cfg` (a RunConfig) that a deployment's config may not
        set, each with the setting that would allow it: one refusal says all that is wrong."""
        found = list(self.refusals(cfg, cwd))
        if len(found) == 1:
            raise ConfigError(found[0])
        if found:
            raise ConfigError(
                f"{len(found)} fields may not be set in a deployment run: "
                + " ".join(f"({i}) {why}" for i, why in enumerate(found, 1))
            )

    def refusals(self, cfg: Any, cwd: str | None = None) -> Iterator[str]:
        """Why each field of `cfg` that a deployment's config may not set is refused, in the
        config's order."""
        for field, spec in cfg.code:
            why = self.reward_refusal(spec, cwd)
            if why:
                yield (
                    f"{field} {spec!r} may not run in a deployment run: {why}. "
                    "A config from the API or the UI may name the built-in rewards and the reward files "
                    "and modules the operator allowed; " + HOW_TO_ALLOW.format(paths=ENV_PATHS, modules=ENV_MODULES)
                )
        for d in declared():
            if d.path.startswith("rewards[]") or d.path in ("eval.rewards", *CODE_LISTED):
                continue  # above: the code the config names (RunConfig.code)
            value = value_of(cfg, d.path)
            if d.trust is Trust.PROGRAM and d.path not in self.fields and value != value_of(_default(), d.path):
                yield (
                    f"{d.path}={value!r} may not be set in a deployment run: it names a program "
                    f"this machine would run. An operator allows it with `grpo serve --allow-field {d.path}` "
                    f"(or {ENV_FIELDS}={d.path} in the environment of the process that runs the flow)"
                )
            if d.trust in (Trust.READS, Trust.WRITES):
                why = self.place_refusal(d.path, value, cwd)
                if why:
                    yield (
                        f"{d.path}={value!r} may not be set in a deployment run: {why}. An operator allows a "
                        f"folder or bucket prefix with `grpo serve --allow-root ROOT` (or {ENV_ROOTS}=ROOT,... in "
                        "the environment of the process that runs the flow, e.g. a work-pool worker)"
                    )
            if d.trust is Trust.ADDRESS:
                why = self.address_refusal(d.path, value, cfg.storage_url)
                if why:
                    yield (
                        f"{d.path}={value!r} may not be set in a deployment run: {why}. An operator allows a host "
                        f"with `grpo serve --allow-host HOST[:PORT]` ({ENV_HOSTS}=...) or the field with "
                        f"`grpo serve --allow-field {d.path}` ({ENV_FIELDS}=...)"
                    )
            if d.api_max is not None and isinstance(value, (int, float)) and not isinstance(value, bool):
                most = self.limit(d.path, d.api_max)
                most = int(most) if most == int(most) else most
                if value > most:
                    yield (
                        f"{d.path}={value!r} is more than a deployment run may ask for ({most}). An operator "
                        f"raises the limit with `grpo serve --raise-limit {d.path}=N` (or {ENV_LIMITS}="
                        f"{d.path}=N,... in the environment of the process that runs the flow)"
                    )
        for field, spec in cfg.reward_models:  # a reward model's folder is a place read, as model.path's
            why = self.place_refusal(field, spec.model, cwd)
            if why:
                raise ConfigError(
                    f"{field}={spec.model!r} may not be set in a deployment run: {why}. An operator allows a "
                    f"folder or bucket prefix with `grpo serve --allow-root ROOT` (or {ENV_ROOTS}=ROOT,... in the "
                    "environment of the process that runs the flow, e.g. a work-pool worker)"
                )
            for name in RewardSpec.MODEL_ONLY:  # work: its batch size and length, within their declared limits
                value, most = getattr(spec, name), api_max_of(_REWARD_FIELDS[name])
                most = None if most is None else self.limit(f"rewards[].{name}", most)
                if isinstance(value, int) and most is not None and value > most:
                    raise ConfigError(
                        f"{field.rsplit('.', 1)[0]}.{name}={value!r} is more than a deployment run may ask for "
                        f"({most:g}). An operator raises the limit with `grpo serve --raise-limit rewards[].{name}=N` "
                        f"(or {ENV_LIMITS}=rewards[].{name}=N,... in the environment of the process that runs the flow)"
                    )
        for total in TOTALS:  # each factor within its limit, the product within its own
            most = self.limit(total.name, total.api_max)
            if total.of(cfg) > most:
                yield (
                    f"{total.name} = {total.spelled(cfg)} is more than a deployment run may ask for ({most:,.0f}). "
                    f"An operator raises the limit with `grpo serve --raise-limit {total.name}=N` (or {ENV_LIMITS}="
                    f"{total.name}=N,... in the environment of the process that runs the flow)"
                )

    def check_run_url(self, run_url: str, cwd: str | None = None) -> None:
        """The evaluate deployment's run folder: a place it reads and writes, under an allowed root."""
        where = _place(run_url, cwd or os.getcwd())
        default_root = _place(DEFAULT_STORAGE_ROOT, cwd or os.getcwd())
        if _under(where, default_root) or any(_under(where, root) for root in self.roots):
            return
        raise ConfigError(
            f"run_url={run_url!r} may not be evaluated in a deployment run: {where} is not under a root this "
            f"deployment's runs use ({_listed(self.roots)}). An operator allows a folder or bucket prefix with "
            f"`grpo serve --allow-root ROOT` (or {ENV_ROOTS}=ROOT,...)"
        )


def check_allowed_fields(fields: tuple[str, ...], where: str) -> tuple[str, ...]:
    """The fields an operator may allow by name: the PROGRAM and ADDRESS ones."""
    allowed = fields_of(Trust.PROGRAM, Trust.ADDRESS)
    unknown = [f for f in fields if f not in allowed]
    if unknown:
        raise ConfigError(f"{where} names {unknown}, which are not among {list(allowed)}")
    return fields


def parse_limits(items: tuple[str, ...] | list[str], where: str) -> tuple[tuple[str, float], ...]:
    """FIELD=N items (the operator's limits on work) checked against the fields that have one."""
    bounded = {d.path for d in declared() if d.api_max is not None} | {t.name for t in TOTALS}
    out = []
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in bounded:
            raise ConfigError(f"{where} {item!r} must be FIELD=N with FIELD one of {sorted(bounded)}")
        try:
            out.append((name, float(raw)))
        except ValueError:
            raise ConfigError(f"{where} {item!r}: {raw!r} is not a number") from None
    return tuple(out)


def refused_job_variables(job_variables: Mapping[str, Any] | None) -> str | None:
    """Why a flow run's job variables may not be used: they set the policy's own variables in the
    environment of the process that runs the flow (Prefect's process work pools pass `env` on)."""
    env = (job_variables or {}).get("env") if isinstance(job_variables, Mapping) else None
    named = sorted(k for k in (env or {}) if k in (*TRUST_ENV, *TRACKER_ENV)) if isinstance(env, Mapping) else []
    if named:
        return (
            f"job_variables.env sets {', '.join(named)}: what a deployment run may reach (and where its trackers "
            "send) is the operator's to "
            "say, in the environment of the process that runs the flow (grpo serve --allow-*, or a work-pool "
            "worker's environment), not in a run's job variables"
        )
    return None


@functools.lru_cache(maxsize=1)
def _default() -> RunConfig:
    return RunConfig.from_dict({})


def value_of(cfg: Any, dotted: str) -> Any:
    """A RunConfig's value of a dotted field (storage.root included)."""
    if dotted == "storage.root":
        return cfg.storage_root
    obj = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part) if obj is not None else None  # an optional section left out: None
    return obj


def _is_place(field: str, value: str) -> bool:
    """Whether a field's value names a folder, file or URL (not a Hub id, 'synthetic', a run name)."""
    if field in fields_of(Trust.WRITES) or "://" in value:
        return True
    if field == "model.init_from":
        ref = value.split("@")[0].strip("/")
        return "/" in ref or value.startswith((".", "~"))
    if value in ("synthetic", "char", "auto"):
        return False
    path = os.path.expanduser(value)
    return value.startswith(("/", ".", "~")) or value.endswith(_FILE_SUFFIXES) or os.path.exists(path)


def _host(value: str) -> tuple[str, int | None] | None:
    """(host, port) of a URL or a host:port, lower-case; None for a bare name."""
    text = value if "://" in value else f"//{value}" if ":" in value else None
    if text is None:
        return None
    try:
        parts = urlsplit(text)
        return (parts.hostname or "").lower(), parts.port
    except ValueError:
        return (value.lower(), None)


def _place(value: str, cwd: str) -> str:
    """A URL without its trailing slash, or a local path made real and absolute."""
    if "://" in value:
        return value.rstrip("/")
    return os.path.realpath(os.path.join(cwd, os.path.expanduser(value)))


def _under(where: str, root: str) -> bool:
    if "://" in where or "://" in root:
        if ".." in where.split("://", 1)[-1].split("/"):  # gs://bucket/runs/../other is not under runs
            return False
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


# -- reads: the files a place holds, by what they resolve to --------------------------------------
# A place's name is checked above (made real first); what it holds is checked here: a data folder's
# files, a model or tokenizer folder's, init_from's run folder, the evaluate deployment's run
# folder. A link among them is read as its target, so the target is what must lie under a root.


def check_reads(policy: TrustPolicy, cfg: Any, cwd: str | None = None) -> None:
    """ConfigError naming the first READS field of `cfg` (a RunConfig that passed policy.check)
    whose folder holds a link that resolves outside the places a deployment run may read: the
    operator's roots and the default storage root. Names and links only (a scandir of each
    folder, a realpath of each link), nothing opened: a data folder of thousands of files is
    walked in milliseconds. A URL (gs://) has no links: its name, checked by policy.check, is all."""
    cwd = cwd or os.getcwd()
    values = dict(place_values(cfg, Trust.READS))
    for field, path in read_places(cfg, cwd):
        check_folder(policy, field, values[field], path, cwd)


def check_folder(policy: TrustPolicy, field: str, value: Any, path: str, cwd: str | None = None) -> None:
    """ConfigError naming `field` (whose value is `value`) when `path` or a link under it resolves
    outside the allowed roots; a URL passes (it has no links)."""
    if "://" in path:
        return
    cwd = cwd or os.getcwd()
    found = link_out(os.path.join(cwd, os.path.expanduser(path)), (*policy.roots, _place(DEFAULT_STORAGE_ROOT, cwd)))
    if found is None:
        return
    link, target = found
    raise ConfigError(
        f"{field}={value!r} may not be read in a deployment run: {link} is a link to {target}, which is not where "
        f"this deployment's runs read ({_listed(policy.roots)}). An operator allows a folder or bucket prefix with "
        f"`grpo serve --allow-root ROOT` (or {ENV_ROOTS}=ROOT,... in the environment of the process that runs "
        "the flow, e.g. a work-pool worker)"
    )


def read_places(cfg: Any, cwd: str | None = None) -> list[tuple[str, str]]:
    """(field, local path) of each READS place `cfg` names other than the default config's: data
    files and folders, model, tokenizer and reward model folders, and model.init_from's run
    folders (a run name or pattern: those under storage.root it may name)."""
    import fnmatch  # here, not with the module's imports: only a deployment run's walk needs it

    cwd = cwd or os.getcwd()
    out = []
    for field, value in place_values(cfg, Trust.READS):
        if not isinstance(value, str) or not value or ("[" not in field and value == value_of(_default(), field)):
            continue
        ref = value.split("@")[0] if field == "model.init_from" else value
        if _is_place(field, value):
            out.append((field, ref))
        elif field == "model.init_from" and "://" not in cfg.storage_url:
            runs = os.path.join(cwd, os.path.expanduser(cfg.storage_url))
            if not any(c in ref for c in "*?["):
                out.append((field, os.path.join(runs, ref)))
                continue
            try:
                names = sorted(e.name for e in os.scandir(runs) if e.is_dir() and not e.name.startswith("_"))
            except OSError:
                names = []  # no storage root yet: no run to start from
            out += [(field, os.path.join(runs, n)) for n in names if fnmatch.fnmatchcase(n, ref)]
    return out


def link_out(path: str, roots: tuple[str, ...]) -> tuple[str, str] | None:
    """(the name, its target) of `path` or of the first link under it whose target is under none
    of `roots` (a dangling link's included), or None. A link to a folder inside is walked too,
    each real folder once (a loop of links ends)."""
    inside = lambda real: any(_under(real, root) for root in roots)
    real = os.path.realpath(path)
    if not inside(real):
        return path, real
    seen, todo = {real}, [(path, real)]  # (the name as reached, its real path)
    while todo:
        shown, folder = todo.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:  # not a folder, or one that cannot be listed: its reader fails naming it
            continue
        for e in entries:
            name = os.path.join(shown, e.name)
            if e.is_symlink():
                target = os.path.realpath(e.path)
                if not inside(target):
                    return name, target
                if os.path.isdir(target) and target not in seen:
                    seen.add(target)
                    todo.append((name, target))
            elif e.is_dir(follow_symlinks=False) and e.path not in seen:
                seen.add(e.path)
                todo.append((name, e.path))
    return None
