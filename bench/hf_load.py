"""Benchmark: loading a Hugging Face safetensors checkpoint into the engine, against transformers.

    python -m bench.hf_load [--workload small|qwen3-0.6b|tiny|all] [--format single|sharded|all]
                            [--repeats N] [--json out.json]

Workloads (random f32 weights, Qwen3-shaped, tied embeddings): "small" is bench.grpo_step's small
model (vocab 384, hidden 512, 8 layers: 23.7 M parameters, 95 MB); "qwen3-0.6b" is that preset's
shape in f32 (vocab 151936, hidden 1024, 28 layers: 596 M parameters, 2.4 GB); "tiny" (0.3 M) is
for the tests. `all` = small and qwen3-0.6b. Each is built once in its own process with
create_model and written with grpo_core.nn.hf.save_hf_model (config.json + model.safetensors), and
copied into 4 shards with a model.safetensors.index.json ("sharded"), in a temporary folder.

Every measurement is a fresh process. It first imports everything the loader needs (jax and
grpo_core, or torch and the transformers model class) and starts the JAX CPU client, reads its
RSS and resets the kernel's high-water mark (`echo 5 > /proc/self/clear_refs`, so the imports'
peak does not count), then times:
  ours          grpo_core.nn.hf.load_hf_model(folder), then jax.block_until_ready on every parameter;
  transformers  AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32) on CPU. Its
                parameters are memory-mapped views of the file that are read on first use, so
                "ready" adds one pass reading every parameter (its sum); for ours ready = load.
Reported: load and ready wall seconds, the peak RSS above the RSS before loading (VmHWM, taken
after ready) and that peak as a multiple of the weights' size on disk, split into anonymous
memory and file-backed pages (page cache mapped from the checkpoint, which the kernel can drop)
by a thread that samples /proc/self/status every 2 ms. Times and peaks are medians over N
processes, engines alternating; the page cache is warm (the files were just written). The build
process also reports save_hf_model's time and its peak RSS above the process's RSS before the
save (the model, after freed heap is returned to the OS).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

WORKLOADS = {"small": dict(repeats=3), "qwen3-0.6b": dict(repeats=2), "tiny": dict(repeats=1)}
ALL = ("small", "qwen3-0.6b")
FORMATS = ("single", "sharded")
ENGINES = ("ours", "transformers")
SHARDS = 4
MIB = 2**20


def model_config(name: str):
    from grpo_core.config.presets import get_preset

    if name == "qwen3-0.6b":
        return get_preset(name, dtype="float32", param_dtype="float32")
    return get_preset(name, vocab_size=384, tie_word_embeddings=True, dtype="float32", param_dtype="float32")


# -- memory --------------------------------------------------------------------------------


def status_mib() -> dict[str, float]:
    """VmRSS, VmHWM, RssAnon and RssFile of this process in MiB (Linux /proc)."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return out


class PeakMemory:
    """Peak RSS of this process above its RSS at entry, with the anonymous / file-backed split.

    VmHWM is exact (the kernel keeps it); the split comes from sampling, so it can miss a peak
    shorter than the sampling period.
    """

    def __init__(self, period_s: float = 0.002):
        self.period_s, self.peak = period_s, {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()

    def __enter__(self):
        self.before = status_mib()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS now
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            s = status_mib()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])
            self._stop.wait(self.period_s)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.after = status_mib()

    def result(self) -> dict[str, float]:
        b = self.before
        return {
            "rss_before_mib": b["VmRSS"],
            "peak_extra_mib": self.after["VmHWM"] - b["VmRSS"],
            "anon_peak_extra_mib": max(self.peak["RssAnon"], self.after["RssAnon"]) - b["RssAnon"],
            "file_peak_extra_mib": max(self.peak["RssFile"], self.after["RssFile"]) - b["RssFile"],
            "held_extra_mib": self.after["VmRSS"] - b["VmRSS"],
        }


# -- child processes -----------------------------------------------------------------------


def _release_free_heap() -> None:
    """Hand freed heap pages back to the OS (glibc), so the RSS before a measurement is what is live."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the baseline may include freed memory
        pass


def build(name: str, folder: str) -> dict:
    """Create the workload's model, save it with save_hf_model; time and peak memory of the save."""
    import jax
    from flax import nnx

    from grpo_core.nn.hf import save_hf_model
    from grpo_core.nn.model import create_model

    cfg = model_config(name)
    model = create_model(cfg, 0)
    jax.block_until_ready(nnx.state(model))
    _release_free_heap()  # initialisation leaves ~0.8x the weights freed but mapped
    with PeakMemory() as mem:
        t = time.perf_counter()
        save_hf_model(model, folder)
        save_s = time.perf_counter() - t
    return {"params_m": cfg.num_params() / 1e6, "save_s": save_s, **{f"save_{k}": v for k, v in mem.result().items()}}


def measure(engine: str, folder: str) -> dict:
    """Load `folder` with one engine, everything it imports already imported."""
    if engine == "ours":
        import jax
        import numpy as np
        from flax import nnx

        import grpo_core.nn.model  # noqa: F401  (load_hf_model imports it)
        from grpo_core.nn.hf import load_hf_model

        jax.device_put(np.zeros(8)).block_until_ready()  # start the CPU client outside the timing
        with PeakMemory() as mem:
            t = time.perf_counter()
            jax.block_until_ready(nnx.state(load_hf_model(folder)))
            load_s = ready_s = time.perf_counter() - t
    else:
        import torch
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
        with open(os.path.join(folder, "config.json")) as f:
            getattr(transformers, json.load(f)["architectures"][0])  # import the lazy model module now
        with PeakMemory() as mem, torch.no_grad():
            t = time.perf_counter()
            model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
            load_s = time.perf_counter() - t
            for p in model.parameters():  # fault in the memory-mapped weights
                p.sum()
            ready_s = time.perf_counter() - t
    return {"load_s": load_s, "ready_s": ready_s, **mem.result()}


def shard(folder: str, out: str, n: int = SHARDS) -> None:
    """Copy model.safetensors of `folder` into about n shards plus an index, the layout
    save_pretrained writes (a tensor larger than a shard gets a shard of its own)."""
    import struct

    from safetensors import safe_open
    from safetensors.numpy import save_file

    src = os.path.join(folder, "model.safetensors")
    with open(src, "rb") as f:  # the header gives each tensor's byte range without reading it
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    groups: list[list[str]] = [[]]
    size, limit = 0, os.path.getsize(src) / n
    for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        nbytes = info["data_offsets"][1] - info["data_offsets"][0]
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    os.makedirs(out, exist_ok=True)
    shutil.copy(os.path.join(folder, "config.json"), out)
    weight_map = {}
    with safe_open(src, framework="numpy") as h:
        for i, names in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file({k: h.get_tensor(k) for k in names}, os.path.join(out, fname), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(names, fname))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": disk_bytes(out)}, "weight_map": weight_map}, f, indent=1)


def disk_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".safetensors"))


# -- driver --------------------------------------------------------------------------------


def _child(*args: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "bench.hf_load", "--child", *args], capture_output=True, text=True, cwd=root
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench.hf_load --child {' '.join(args)} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_workload(name: str, formats: list[str], repeats: int, tmp: str) -> tuple[dict, list[dict]]:
    """Build the workload's checkpoint, then `repeats` load processes per format and engine."""
    folders = {f: os.path.join(tmp, name, f) for f in FORMATS}
    built = dict(workload=name, **_child("build", "--workload", name, "--folder", folders["single"]))
    built["weights_mib"] = disk_bytes(folders["single"]) / MIB
    if "sharded" in formats:
        shard(folders["single"], folders["sharded"])
    rows = []
    for fmt in formats:
        runs: dict[str, list[dict]] = {e: [] for e in ENGINES}
        for _ in range(repeats):  # engines alternate, so drift (page cache, other load) hits both
            for e in ENGINES:
                runs[e].append(_child("measure", "--engine", e, "--folder", folders[fmt]))
        weights_mib = disk_bytes(folders[fmt]) / MIB
        for e in ENGINES:
            med = {k: statistics.median(r[k] for r in runs[e]) for k in runs[e][0]}
            rows.append(
                dict(
                    workload=name,
                    format=fmt,
                    engine=e,
                    weights_mib=weights_mib,
                    **med,
                    peak_x=med["peak_extra_mib"] / weights_mib,
                    anon_x=med["anon_peak_extra_mib"] / weights_mib,
                    file_x=med["file_peak_extra_mib"] / weights_mib,
                    runs=runs[e],
                )
            )
    return built, rows


def _table(built: list[dict], rows: list[dict]) -> str:
    cols = [
        ("workload", "{:<10}"),
        ("format", "{:<7}"),
        ("engine", "{:<12}"),
        ("load_s", "{:>7.2f}"),
        ("ready_s", "{:>7.2f}"),
        ("peak_extra_mib", "{:>9.0f}"),
        ("peak_x", "{:>9.2f}"),
        ("anon_x", "{:>6.2f}"),
        ("file_x", "{:>6.2f}"),
        ("held_extra_mib", "{:>9.0f}"),
    ]
    heads = [
        "workload",
        "format",
        "engine",
        "load s",
        "ready s",
        "peak+ MiB",
        "x weights",
        "anon x",
        "file x",
        "held MiB",
    ]
    widths = [len(fmt.format(0 if "f" in fmt else "")) for _, fmt in cols]
    out = [
        "weights on disk (f32): "
        + ", ".join(f"{b['workload']} {b['weights_mib']:.1f} MiB ({b['params_m']:.1f} M params)" for b in built)
        + "; page cache warm",
        "",
        " ".join(f"{h:<{w}}" if fmt.startswith("{:<") else f"{h:>{w}}" for h, w, (_, fmt) in zip(heads, widths, cols)),
    ]
    out += [" ".join(fmt.format(r[k]) for k, fmt in cols) for r in rows]
    out.append("")
    by = {(r["workload"], r["format"], r["engine"]): r for r in rows}
    for (w, f, e), ours in by.items():
        if e != "ours":
            continue
        hf = by[(w, f, "transformers")]
        out.append(
            f"{w} {f}: ours ready in {ours['ready_s']:.2f} s vs transformers {hf['ready_s']:.2f} s "
            f"(ours {hf['ready_s'] / ours['ready_s']:.2f}x as fast); peak extra {ours['peak_x']:.2f}x vs "
            f"{hf['peak_x']:.2f}x the weights"
        )
    for b in built:
        out.append(
            f"{b['workload']}: save_hf_model {b['save_s']:.2f} s, peak {b['save_peak_extra_mib']:.0f} MiB above "
            f"the model ({b['save_peak_extra_mib'] / b['weights_mib']:.2f}x the weights)"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", choices=[*WORKLOADS, "all"], default="all")
    ap.add_argument("--format", choices=[*FORMATS, "all"], default="all")
    ap.add_argument("--repeats", type=int, help="load processes per engine and format (default: 3 small, 2 qwen3-0.6b)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--child", choices=["build", "measure"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "build":
        print(json.dumps(build(args.workload, args.folder)))
        return 0
    if args.child == "measure":
        print(json.dumps(measure(args.engine, args.folder)))
        return 0
    formats = list(FORMATS) if args.format == "all" else [args.format]
    built, rows = [], []
    with tempfile.TemporaryDirectory(prefix="bench-hf-load-") as tmp:
        for name in ALL if args.workload == "all" else [args.workload]:
            b, r = run_workload(name, formats, args.repeats or WORKLOADS[name]["repeats"], tmp)
            built.append(b)
            rows += r
            shutil.rmtree(os.path.join(tmp, name))  # 2 x 2.4 GB for qwen3-0.6b
    print(_table(built, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"built": built, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
