"""An XLA profile of a few steps, summarised as the programs and ops (GPU kernels, TPU ops, CPU
thunks) that took the most device time: where the next speed change should start.

    with profile.capture() as prof:     # jax.profiler's trace of what runs inside
        step(); step()
    print(profile.table(prof.summary(top=15)))

Read with jax.profiler.ProfileData (no TensorBoard needed). Time is summed per (program, op)
over the device's own timelines (GPU streams, TPU cores; on CPU, XLA's thunk threads), so it is
device time, not wall time: the gaps between ops (a host waiting, a launch) show as the
difference between the steps' wall time and the sum here.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import os
import shutil
import tempfile


class Capture:
    def __init__(self, folder: str):
        self.folder = folder
        self.path: str | None = None

    def summary(self, top: int = 15) -> dict:
        """{"total_ms", "ops": [{"program", "op", "calls", "ms", "share"}...] (top by time), "device"}."""
        if self.path is None:
            raise RuntimeError("the profile is read after the capture ends")
        return summarise(self.path, top)


@contextlib.contextmanager
def capture(keep: str | None = None):
    """Trace what runs inside the block; `keep`: a folder to leave the .xplane.pb in (for
    TensorBoard/XProf), else a temporary one removed once summarised."""
    import jax

    folder = keep or tempfile.mkdtemp(prefix="grpo-profile-")
    cap = Capture(folder)
    jax.profiler.start_trace(folder)
    try:
        yield cap
    finally:
        jax.profiler.stop_trace()
        found = sorted(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
        cap.path = found[-1] if found else None
        if cap.path and keep is None:
            data = open(cap.path, "rb").read()
            shutil.rmtree(folder, ignore_errors=True)
            cap.path = os.path.join(tempfile.mkdtemp(prefix="grpo-profile-"), "trace.xplane.pb")
            with open(cap.path, "wb") as f:
                f.write(data)


CONTAINERS = ("while", "conditional", "call")  # ops whose time is their body's ops' (CPU thunks nest)


def summarise(path: str, top: int = 15) -> dict:
    from jax.profiler import ProfileData

    data = ProfileData.from_file(path)
    device_planes = [p for p in data.planes if p.name.startswith("/device:") and "CUSTOM" not in p.name]
    planes = device_planes or [p for p in data.planes if p.name.startswith("/host:CPU")]
    ns: dict[tuple[str, str], float] = collections.defaultdict(float)
    calls: dict[tuple[str, str], int] = collections.Counter()
    for plane in planes:
        on_device = plane.name.startswith("/device:")
        for line in _op_lines(plane) if on_device else plane.lines:
            for ev in line.events:
                stats = dict(ev.stats)
                op = stats.get("hlo_op") or (ev.name if on_device else None)
                if op is None or str(op).startswith(CONTAINERS):
                    continue
                key = (str(stats.get("hlo_module", "?")), str(op))
                ns[key] += ev.duration_ns
                calls[key] += 1
    total = sum(ns.values())
    rows = [
        {"program": k[0], "op": k[1], "calls": calls[k], "ms": v / 1e6, "share": v / total if total else 0.0}
        for k, v in sorted(ns.items(), key=lambda kv: -kv[1])[:top]
    ]
    by_program: dict[str, float] = collections.defaultdict(float)
    for (prog, _), v in ns.items():
        by_program[prog] += v
    programs = [{"program": p, "ms": v / 1e6} for p, v in sorted(by_program.items(), key=lambda kv: -kv[1])]
    return {"device": planes[0].name if planes else "?", "total_ms": total / 1e6, "ops": rows, "programs": programs}


def _op_lines(plane) -> list:
    """The timelines of a device plane that hold its ops once: 'XLA Ops' where the plane has one
    (TPU, newer GPU runtimes), else the GPU's streams; never the step or module lines, which
    would count the same time again."""
    lines = list(plane.lines)
    ops = [line for line in lines if line.name.lower() == "xla ops"]
    return ops or [line for line in lines if "stream" in line.name.lower()]


def table(summary: dict) -> str:
    out = [
        f"XLA profile ({summary['device']}): {summary['total_ms']:.1f} ms of device time in ops; by program: "
        + ", ".join(f"{p['program']} {p['ms']:.1f} ms" for p in summary["programs"][:6]),
        "",
        "program | op | calls | ms | share",
        "--- | --- | --- | --- | ---",
    ]
    for r in summary["ops"]:
        out.append(f"{r['program'][:40]} | {r['op'][:60]} | {r['calls']} | {r['ms']:.2f} | {100 * r['share']:.1f} %")
    return "\n".join(out)
