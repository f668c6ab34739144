"""Device meshes, and where each of training's arrays lives on them.

`train.mesh` (config.MeshConfig) sizes three axes over every device of the run, all hosts
included: `data` splits batches; `fsdp` splits batches and every parameter's hidden dimension,
optimizer state with it (ZeRO-3); `tensor` splits heads, MLP width and vocabulary. Which
dimension goes over which axis follows the decoder's parameter names (partition_axes, KV_CACHE_AXES, below);
`fit` keeps an axis only where its size divides the dimension, so any mesh runs any model.

Three roles, one mesh each (`Placement`): the learner's (parameters, optimizer state, update
batches), the rollout's (the sampler's weights, prompts and KV cache) and the reference
policy's. The rollout and reference meshes default to the learner's: the same arrays, no copy.
Another layout of the same devices (say fsdp for the update, tensor x data for decoding, where
fsdp would all-gather every weight at every token) costs one copy of the weights and a
reshard per rollout.

Multi-host: JAX runs one program over every process's devices, and each process must feed it the
same host values. `put` builds a global array from a host value every process holds whole (each
process makes only its own shards: nothing is broadcast, so a value that differs between
processes silently yields a wrong array; readiness and the worker check the inputs agree), and
`to_host` brings a global array back whole to every process.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from grpo_core.config.train import MESH_AXES, MeshConfig, MeshShape

log = logging.getLogger(__name__)
BATCH = ("data", "fsdp")  # the axes a batch's leading (row) dimension is split over


def make_mesh(shape: MeshShape, devices: Sequence | None = None, field: str = "train.mesh") -> Mesh:
    """A mesh with axes MESH_AXES over `devices` (default: every device of every process).

    Auto axes: shardings are annotations the compiler propagates (jax >= 0.7 makes Explicit
    axes the default of jax.make_mesh, which would type every array by its sharding)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = shape.sizes(len(devices), field)
    try:
        from jax.sharding import AxisType  # newer JAX only (below: the fallback)

        kw: dict[str, Any] = {"axis_types": (AxisType.Auto,) * len(MESH_AXES)}
    except ImportError:  # older jax: every axis is Auto
        kw = {}
    return jax.make_mesh(sizes, MESH_AXES, devices=devices, **kw)


def fit(axes: Sequence, shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """A PartitionSpec from the wanted axes of each dimension (None, a name, or a tuple of names
    split in that order): an axis of size 1 is left out, and a dimension keeps the longest
    prefix of its axes whose sizes divide it. Trailing Nones are dropped, the form the compiler
    gives its outputs: an update's new state then has the very shardings of the old one, and
    the next call finds the compiled program instead of compiling another."""
    spec = []
    for dim, want in zip(shape, axes):
        names = () if want is None else (want,) if isinstance(want, str) else tuple(want)
        kept, size = [], 1
        for a in names:
            n = mesh.shape[a]
            if n == 1:
                continue
            if dim % (size * n):
                break
            kept.append(a)
            size *= n
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def constrain(x: jax.Array, axes: Sequence, mesh: Mesh) -> jax.Array:
    """Inside a jitted function: lay `x` out over `mesh` as `axes` says (see fit)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, fit(axes, x.shape, mesh)))


def path_names(path) -> tuple[str, ...]:
    """('model', 'layers', 'mlp', 'up_proj', 'kernel', 'value') from a jax key path."""
    out = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                out.append(str(getattr(k, attr)))
                break
    return tuple(out)


def put(x, sharding: NamedSharding):
    """`x` (a host array or a jax.Array) laid out as `sharding`; unchanged if it already is.

    With several processes, every process must pass the same value (see the module doc). Shapes
    (a jax.ShapeDtypeStruct: a state a checkpoint will fill) get the sharding and stay shapes."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.Array):
        if x.sharding == sharding:
            return x
        if not (x.is_fully_addressable and not sharding.is_fully_addressable):
            return jax.device_put(x, sharding)  # device to device, across processes too
        x = np.asarray(jax.device_get(x))  # a process-local array: every process has it whole
    x = np.asarray(x)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(tree):
    """Device arrays to numpy, whole on every process (gathered where they span processes).
    A host sync: call it where the driver means to wait."""

    def spread(x):
        return isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated

    if not any(spread(x) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)

    return jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)) if spread(x) else jax.device_get(x), tree
    )


@dataclasses.dataclass(frozen=True)
class Placement:
    """The learner's, the rollout's and the reference policy's meshes, and where each kind of
    array goes on them. Every method takes host arrays or jax.Arrays and returns jax.Arrays."""

    train: Mesh
    rollout: Mesh
    reference: Mesh

    @classmethod
    def from_config(cls, cfg: MeshConfig | None = None, devices: Sequence | None = None) -> "Placement":
        cfg = cfg if cfg is not None else MeshConfig()
        devices = list(jax.devices() if devices is None else devices)
        train = make_mesh(cfg, devices)
        role = lambda shape, field: train if shape is None else make_mesh(shape, devices, field)
        out = cls(train, role(cfg.rollout, "train.mesh.rollout"), role(cfg.reference, "train.mesh.reference"))
        log.info("mesh %s", out.describe())
        return out

    def describe(self) -> str:
        shape = lambda m: "x".join(f"{a}={n}" for a, n in m.shape.items())
        out = f"train {shape(self.train)}"
        if self.rollout is not self.train:
            out += f"; rollout {shape(self.rollout)}"
        if self.reference is not self.train:
            out += f"; reference {shape(self.reference)}"
        return out

    # -- shardings -------------------------------------------------------------------------

    def param_shardings(self, tree, mesh: Mesh | None = None):
        """NamedShardings for a tree of parameters, or of anything whose paths end with a
        parameter's (optimizer moments); leaves the model does not know are replicated."""
        return jax.tree_util.tree_map_with_path(
            lambda path, x: self.param_sharding(path_names(path), np.shape(x), mesh), tree
        )

    def param_sharding(self, names: Sequence[str], shape: Sequence[int], mesh: Mesh | None = None) -> NamedSharding:
        """The sharding of the parameter at path `names` (('model', 'layers', 'mlp', 'up_proj',
        'kernel')) with this shape."""
        shape = tuple(shape)
        return NamedSharding(
            mesh or self.train, fit(partition_axes(tuple(names), len(shape)), shape, mesh or self.train)
        )

    def batch_sharding(self, shape: Sequence[int], mesh: Mesh | None = None) -> NamedSharding:
        """Rows (the leading dimension) over data x fsdp, as far as they divide."""
        mesh = mesh or self.train
        return NamedSharding(mesh, fit((BATCH,) + (None,) * (len(shape) - 1), shape, mesh))

    def replicated(self, mesh: Mesh | None = None) -> NamedSharding:
        return NamedSharding(mesh or self.train, PartitionSpec())

    # -- placing ---------------------------------------------------------------------------

    def put_params(self, tree, mesh: Mesh | None = None):
        return jax.tree.map(put, tree, self.param_shardings(tree, mesh))

    def put_batch(self, tree, mesh: Mesh | None = None):
        return jax.tree.map(lambda x: put(x, self.batch_sharding(np.shape(x), mesh)), tree)

    def put_replicated(self, tree, mesh: Mesh | None = None):
        return jax.tree.map(lambda x: put(x, self.replicated(mesh)), tree)

    def init_opt_state(self, tx, params):
        """tx.init(params) with every moment laid out like its parameter: compiled with those
        output shardings, so no device ever holds a whole moment."""
        shapes = jax.eval_shape(tx.init, params)
        return jax.jit(tx.init, out_shardings=self.param_shardings(shapes))(params)

    def spread_rollout(self) -> Mesh | None:
        """The rollout mesh where it has several devices, else None: one device's arrays stay
        where they lie (evaluation's weights, prompts and KV cache)."""
        return None if self.rollout.size == 1 else self.rollout

    def rollout_params(self, params):
        """The sampler's weights: the learner's own arrays, or a copy laid out on the rollout mesh."""
        return params if self.rollout is self.train else self.put_params(params, self.rollout)

    def reference_params(self, params, copy: bool = True):
        """The reference policy's weights, frozen: on its own mesh, or a copy on the learner's
        (`copy`: the learner donates its own parameters at every update)."""
        if self.reference is not self.train:
            return self.put_params(params, self.reference)

        return jax.tree.map(jnp.copy, params) if copy else params


# -- the decoder's layout: mesh axes by grpo_core.nn.model's parameter names ---------------------
# Mesh axes of each parameter dimension: the hidden size over fsdp; heads, MLP width and
# vocabulary over tensor, Megatron-style (q/k/v/gate/up split their outputs and o/down their
# inputs, so a layer needs one reduction per block); norms whole. The stacked layer axis is never
# split. mesh.fit keeps an axis only where its size divides the dimension, so every model runs on
# every mesh (a 14-head model on tensor=4 keeps its heads whole).
_IN_OUT = {
    "q_proj": ("fsdp", "tensor"),
    "k_proj": ("fsdp", "tensor"),
    "v_proj": ("fsdp", "tensor"),
    "gate_proj": ("fsdp", "tensor"),
    "up_proj": ("fsdp", "tensor"),
    "lm_head": ("fsdp", "tensor"),
    "o_proj": ("tensor", "fsdp"),
    "down_proj": ("tensor", "fsdp"),
}
KV_CACHE_AXES = (None, ("data", "fsdp"), "tensor", None, None)  # (L, B, K, S, D): rows and kv heads


def partition_axes(names: tuple[str, ...], ndim: int) -> tuple:
    """Mesh axes (None: not split) of each dimension of the array at path `names`, e.g.
    ('model', 'layers', 'self_attn', 'q_proj', 'kernel'). An optimizer moment's path ends with
    its parameter's, so it is split the same way; anything unknown stays whole."""
    names = tuple(n for n in names if n != "value")  # nnx.Variable's field
    leaf = names[-1] if names else ""
    if leaf == "embedding":
        trailing = ("tensor", "fsdp")  # (V, E)
    else:
        lin = next((n for n in reversed(names) if n in _IN_OUT), None)
        i, o = _IN_OUT.get(lin, (None, None))
        trailing = (
            {"kernel": (i, o), "bias": (o,), "lora_a": (i, None), "lora_b": (None, o)}.get(leaf, ()) if lin else ()
        )
    if len(trailing) > ndim:
        return (None,) * ndim
    return (None,) * (ndim - len(trailing)) + trailing
