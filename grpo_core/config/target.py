"""The TPU a run is checked for before it exists (pipeline.readiness.target): topology names and
what each chip generation holds. JAX-free: the config validates names with it, the Prefect
side prints from it, and grpo_core.rl.aot compiles for it.

A target is a name as XLA's TPU compiler takes it, `GENERATION:TOPOLOGY` (`v5e:2x2`, `v5e:2x4`,
`v4:2x2x1`, `v6e:4x4`), and a number of slices (multislice: DCN between identical slices).
Cloud names such as `v5e-8` or `v5litepod-8` count cores or chips, not the torus shape, and the
compiler refuses them: the message says which topology name to use instead.
"""

from __future__ import annotations

import dataclasses
import math
import re

from grpo_core.errors import ConfigError

GiB = 2**30

# HBM per chip, from Google's Cloud TPU pages (v4: 32 GiB; v5e: 16 GB; v5p: 95 GB; v6e: 32 GB,
# each chip's own figure). XLA's TPU compiler reports v5e's usable capacity as 15.75 GiB: the
# runtime keeps the rest, which the readiness margin (aot.HEADROOM) also leaves free.
HBM_BYTES = {"v4": 32 * GiB, "v5e": 16 * GiB, "v5p": 95 * GiB, "v6e": 32 * GiB}
# Dense bf16 peak FLOP/s and HBM bandwidth per chip, from each generation's Cloud TPU page
# (PEAKS_SOURCE, its system-architecture table: "Peak compute per chip (bf16)" and the HBM
# bandwidth): v4 275 TFLOP/s and 1,200 GBps; v5e 197 and 819 GBps (one revision of the page
# says "800 GiBps", 859 GB/s; 819 is the key-chip-specifications figure); v5p 459 and 2,765 GBps;
# v6e 918 and 1,638 GBps. A chip's both TensorCores (v4, v5p: megacore) are one JAX device and counted here.
PEAK_BF16_FLOPS = {"v4": 275e12, "v5e": 197e12, "v5p": 459e12, "v6e": 918e12}
HBM_BYTES_PER_S = {"v4": 1200e9, "v5e": 819e9, "v5p": 2765e9, "v6e": 1638e9}
PEAKS_SOURCE = "https://cloud.google.com/tpu/docs/{generation}"
# device_kind as JAX reports it, per generation
DEVICE_KIND = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
# generations whose chips hold two TensorCores, which JAX drives as one device ("megacore")
MEGACORE = ("v4", "v5p")
_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v6lite": "v6e"}
_NAME = re.compile(r"^(v\d+[a-z]*):(\d+(?:x\d+){1,2})$")


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice (or `num_slices` identical slices) to compile for."""

    generation: str  # v4, v5e, v5p, v6e
    shape: tuple[int, ...]  # chips along each torus axis: (2, 2) or (2, 2, 1)
    num_slices: int = 1

    @classmethod
    def parse(cls, name: str, num_slices: int = 1, field: str = "pipeline.readiness.target") -> "Target":
        """`v5e:2x2` (and num_slices) as a Target, or ConfigError naming `field` and what to write."""
        text = str(name).strip().lower()
        m = _NAME.match(text)
        known = ", ".join(HBM_BYTES)
        if not m:
            hint = ""
            cloud = re.match(r"^(v\d+[a-z]*)(?:pod)?-(\d+)$", text)
            if cloud:
                gen = _ALIASES.get(cloud.group(1), cloud.group(1))
                hint = (
                    f"; {name!r} is a Cloud accelerator type (it counts {'cores' if gen in MEGACORE else 'chips'}), "
                    f"the compiler takes the torus shape: e.g. {gen}:2x2 for 4 chips, {gen}:2x4 for 8"
                )
            raise ConfigError(
                f"{field} must look like GENERATION:TOPOLOGY (v5e:2x2, v5e:2x4, v4:2x2x1, v6e:4x4), got {name!r}{hint}"
            )
        gen = _ALIASES.get(m.group(1), m.group(1))
        if gen not in HBM_BYTES:
            raise ConfigError(f"{field}: unknown TPU generation {m.group(1)!r} in {name!r}; known: {known}")
        shape = tuple(int(n) for n in m.group(2).split("x"))
        if any(n < 1 for n in shape):
            raise ConfigError(f"{field}: every axis of {name!r} must be at least 1")
        if isinstance(num_slices, bool) or not isinstance(num_slices, int) or num_slices < 1:
            raise ConfigError(f"pipeline.readiness.num_slices must be an integer >= 1, got {num_slices!r}")
        return cls(gen, shape, num_slices)

    @property
    def name(self) -> str:
        """The topology name XLA takes (one slice)."""
        return f"{self.generation}:{'x'.join(map(str, self.shape))}"

    def __str__(self) -> str:
        return self.name + (f" x {self.num_slices} slices" if self.num_slices > 1 else "")

    @property
    def chips(self) -> int:
        """Chips (JAX devices) over every slice."""
        return math.prod(self.shape) * self.num_slices

    @property
    def hbm_bytes(self) -> int:
        return HBM_BYTES[self.generation]

    @property
    def device_kind(self) -> str:
        return DEVICE_KIND[self.generation]

    def peaks(self) -> dict:
        """The chip's published peaks, per chip, with where they come from."""
        return {
            "generation": self.generation,
            "bf16_flops_per_s": PEAK_BF16_FLOPS[self.generation],
            "hbm_bytes_per_s": HBM_BYTES_PER_S[self.generation],
            "source": PEAKS_SOURCE.format(generation=self.generation),
        }

    def to_dict(self) -> dict:
        return {
            "topology": self.name,
            "num_slices": self.num_slices,
            "generation": self.generation,
            "chips": self.chips,
            "device_kind": self.device_kind,
            "hbm_bytes": self.hbm_bytes,
        }
