"""Hugging Face checkpoints in and out: config.json + safetensors (one file or a sharded index)
of a Qwen2, Qwen3 or Llama model into grpo_core's NNX model, and back (`save_hf_model`).

Names map one to one (HF `model.layers.{i}.self_attn.q_proj.weight` (out, in) becomes row i of
our stacked `model.layers.self_attn.q_proj.kernel` (L, in, out)). Weights stream: each stacked
parameter is assembled on the host from its L tensors, put on its device, and dropped before
the next, so the host never holds a second copy of the whole model. Unknown architectures and
mismatched shapes fail naming the model type or the parameter.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
from typing import Any, Iterator

import jax
import numpy as np
from flax import nnx
from safetensors.flax import save_file

from grpo_core.config.model import hf_config, model_config_from_hf
from grpo_core.errors import ConfigError, excerpt
from grpo_core.nn.model import CausalLM
from grpo_core.runtime.mesh import put

log = logging.getLogger(__name__)


def _files(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()), key=str)
        # a shard is a file beside the index: a path in its place ('../x', '/x') would read outside the
        # folder the trust policy checked (grpo_core.rewards.trust.check_reads), as a link would
        bad = [s for s in shards if not isinstance(s, str) or os.path.basename(s) != s or s in ("", ".", "..")]
        if bad:
            raise ConfigError(
                f"{index}: weight_map names the shard {excerpt(bad[0])}, which is not a file name in the model folder"
            )
        return [os.path.join(folder, s) for s in shards]
    single = os.path.join(folder, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")


_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}


class _Tensors:
    """Every tensor of a checkpoint by name, across shards, as numpy views of the memory-mapped
    files: nothing is read until a tensor is used, and bfloat16 (what most checkpoints hold, and
    what safetensors' numpy reader refuses) comes through ml_dtypes."""

    def __init__(self, folder: str):

        self.where: dict[str, str] = {}
        self._maps: dict[str, tuple[mmap.mmap, int, dict[str, Any]]] = {}
        for path in _files(folder):
            with open(path, "rb") as f:
                mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            try:
                n = int.from_bytes(mm[:8], "little")
                header = json.loads(mm[8 : 8 + n])
            except (ValueError, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path} is not a safetensors file: {exc}") from None
            header.pop("__metadata__", None)
            self._maps[path] = (mm, 8 + n, header)
            for name in header:
                self.where[name] = path

    def drop_pages(self) -> None:
        """Take the pages read so far out of this process's RSS; they stay in the page cache.
        Without this every page read during the load stays mapped until the maps close: a
        second, file-backed copy of the model at the peak (2.05x instead of 1.15x the weights
        above the RSS before loading, for qwen3-0.6b in f32: bench/hf_load.py)."""

        if hasattr(mmap, "MADV_DONTNEED"):  # a file-backed page dropped here re-reads from the cache
            for mm, _, _ in self._maps.values():
                mm.madvise(mmap.MADV_DONTNEED)

    def get(self, name: str) -> np.ndarray:
        import ml_dtypes  # noqa: F401 - registers bfloat16 and float8 with numpy

        if name not in self.where:
            raise KeyError(name)
        mm, base, header = self._maps[self.where[name]]
        info = header[name]
        if info["dtype"] not in _DTYPES:
            raise ConfigError(f"parameter {name}: dtype {info['dtype']} is not supported")
        dtype = np.dtype(getattr(ml_dtypes, _DTYPES[info["dtype"]], None) or _DTYPES[info["dtype"]])
        begin, end = info["data_offsets"]
        return np.frombuffer(mm, dtype, count=(end - begin) // dtype.itemsize, offset=base + begin).reshape(
            info["shape"]
        )


def _hf_names(path: tuple[str, ...], layer: int | None) -> str:
    """Our parameter path (and layer) -> the Hugging Face tensor name."""
    *mods, leaf = path
    hf_leaf = {"kernel": "weight", "embedding": "weight"}.get(leaf, leaf)
    if mods[:2] == ["model", "layers"]:
        return ".".join(["model", "layers", str(layer), *mods[2:], hf_leaf])
    return ".".join([*mods, hf_leaf])


def _host(tensors: _Tensors, name: str, transpose: bool) -> np.ndarray:
    x = tensors.get(name)
    return np.ascontiguousarray(x.T) if transpose else x


def _stream(tensors: _Tensors, flat: dict[tuple[str, ...], Any], num_layers: int) -> Iterator[tuple[tuple, np.ndarray]]:
    for path, like in flat.items():
        transpose = path[-1] == "kernel"
        if path[:2] == ("model", "layers"):
            arr = np.empty(like.shape, like.dtype)  # one stacked parameter at a time
            for i in range(num_layers):
                arr[i] = _check_shape(_host(tensors, _hf_names(path, i), transpose), like.shape[1:], _hf_names(path, i))
        else:
            arr = _check_shape(_host(tensors, _hf_names(path, None), transpose), like.shape, _hf_names(path, None))
        yield path, arr.astype(like.dtype, copy=False)


def _check_shape(x: np.ndarray, want: tuple[int, ...], name: str) -> np.ndarray:
    if tuple(x.shape) != tuple(want):
        raise ConfigError(
            f"parameter {name}: checkpoint has shape {tuple(x.shape)}, the model expects {tuple(want)} "
            "(transposed for kernels)"
        )
    return x


def read_hf_config(folder: str) -> tuple[dict[str, Any], str]:
    """(config.json of a local Hugging Face folder, its path), or ConfigError."""
    cfg_path = os.path.join(folder, "config.json")
    try:
        with open(cfg_path) as f:
            return json.load(f), cfg_path
    except FileNotFoundError:
        raise ConfigError(f"{folder} has no config.json: not a Hugging Face model folder") from None


def load_hf_model(folder: str, dtype: str | None = None, placement=None, **overrides):
    """The NNX model of a local Hugging Face folder (config.json + safetensors).

    With a `placement` (grpo_core.runtime.mesh.Placement), each parameter goes straight to its shards on
    the learner's mesh as it is read: no device ever holds a whole parameter the mesh splits,
    and on a multi-host slice each process sends only its own devices' shards."""

    hf, cfg_path = read_hf_config(folder)
    if dtype:
        overrides.setdefault("dtype", dtype)
        overrides.setdefault("param_dtype", dtype)
    cfg = model_config_from_hf(hf, cfg_path, **overrides)
    return load_weights(folder, lambda: CausalLM(cfg, rngs=nnx.Rngs(0)), cfg.num_hidden_layers, placement)


def load_weights(folder: str, build, num_layers: int, placement=None, mesh=None):
    """The module `build()` makes (built as shapes only) with every parameter read from the
    safetensors of `folder` by its Hugging Face name, streamed one parameter at a time; with a
    `placement`, each put straight onto its shards on `mesh` (default: the learner's)."""
    abstract = nnx.eval_shape(build)
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    flat = {tuple(str(k.key) for k in p): v for p, v in jax.tree_util.tree_flatten_with_path(pure)[0]}
    tensors = _Tensors(folder)
    missing = [(p, _hf_names(p, 0 if p[:2] == ("model", "layers") else None)) for p in flat]
    missing = [n for p, n in missing if n not in tensors.where]
    if missing:
        raise ConfigError(f"{folder}: checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    loaded: dict[tuple, Any] = {}
    for path, arr in _stream(tensors, flat, num_layers):
        if placement is None:
            loaded[path] = jax.device_put(arr)  # host copy freed when `arr` goes
        else:
            loaded[path] = put(arr, placement.param_sharding(path, arr.shape, mesh))
        tensors.drop_pages()
    nested: dict[str, Any] = {}
    for path, v in loaded.items():
        node = nested
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    nnx.replace_by_pure_dict(state, nested)
    return nnx.merge(graphdef, state)


# -- out -----------------------------------------------------------------------------------


def save_hf_model(model, folder: str) -> str:
    """Write `model` as a Hugging Face folder (config.json + model.safetensors) that transformers
    loads with the same logits. Layers are unstacked one parameter at a time."""

    os.makedirs(folder, exist_ok=True)
    cfg = model.config
    pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tensors: dict[str, Any] = {}
    for p, v in jax.tree_util.tree_flatten_with_path(pure)[0]:
        path = tuple(str(k.key) for k in p)
        transpose = path[-1] == "kernel"
        if path[:2] == ("model", "layers"):
            for i in range(cfg.num_hidden_layers):
                tensors[_hf_names(path, i)] = v[i].T if transpose else v[i]
        else:
            tensors[_hf_names(path, None)] = v.T if transpose else v
    tensors = {k: jax.numpy.asarray(t) for k, t in tensors.items()}  # contiguous copies
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config(cfg), f, indent=1)
    return folder
