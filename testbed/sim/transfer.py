"""What moving KV between the GPU and its lower tiers costs: link presets, copy times, and the
load-or-recompute decision.

A copy of ``n`` tokens over a link takes ``latency_s + n · kv_bytes_per_token / bandwidth``. A load
from host DRAM crosses PCIe once; a load from disk is read from the SSD into a host bounce buffer,
then crosses PCIe (two stages, each on its own copy resource in the simulator, so loads queue
behind each other but overlap compute). Writes (demotions, write-through) go the other way; PCIe
is full duplex, so they do not delay loads and are only counted.

`LoadPlanner` is where both decisions that need time live: the scheduler asks it whether a match's
lower-tier run is worth loading (loading must beat recomputing: a short run's fixed latency can
exceed its prefill), and the simulator's driver asks it how long each stage of a load takes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

from testbed.errors import BadInput, check_choice
from testbed.config.model_shape import ModelShape
from testbed.sim.cost_model import RooflineCostModel
from testbed.sim.step_shape import StepShape
from testbed.sim.specs import HardwareSpec


@dataclass(frozen=True)
class TierLink:
    """One link: bytes/s towards the GPU (``read_bw``) and away from it (``write_bw``), and a fixed
    cost per transfer (``latency_s``)."""

    name: str
    read_bw: float
    write_bw: float
    latency_s: float

    def seconds(self, nbytes: float, write: bool = False) -> float:
        return self.latency_s + nbytes / (self.write_bw if write else self.read_bw)


#: Share of a PCIe link's raw rate that pinned-memory copies reach: a stated assumption (packet
#: headers and flow control take ~10-20 %; scattered KV pages lose more unless gathered first).
PCIE_EFFICIENCY = 0.8
#: Fixed cost of one host<->GPU copy: a stated assumption, the order of a kernel launch plus DMA
#: set-up (a few to ~10 µs).
PCIE_LATENCY_S = 10e-6

LINKS: dict[str, TierLink] = {
    # Host DRAM over PCIe 4.0 x16 (A100, A10G): 16 GT/s x 16 lanes x 128b/130b = 31.5 GB/s each
    # way (PCI-SIG PCIe 4.0 base specification).
    "pcie4": TierLink("pcie4", 31.5e9 * PCIE_EFFICIENCY, 31.5e9 * PCIE_EFFICIENCY, PCIE_LATENCY_S),
    # Host DRAM over PCIe 5.0 x16 (H100, H200): 32 GT/s, 63.0 GB/s each way (PCI-SIG PCIe 5.0; the
    # H100 datasheet's "PCIe Gen5 128 GB/s" counts both directions).
    "pcie5": TierLink("pcie5", 63.0e9 * PCIE_EFFICIENCY, 63.0e9 * PCIE_EFFICIENCY, PCIE_LATENCY_S),
    # Local NVMe SSD on PCIe 4.0 x4: Samsung 990 PRO datasheet, 7,450 MB/s sequential read,
    # 6,900 MB/s sequential write; 50 µs per read (TheFPSReview 2024 measured 82 MB/s at 4 KiB,
    # queue depth 1: 4096 B / 82 MB/s).
    "nvme_pcie4": TierLink("nvme_pcie4", 7.45e9, 6.9e9, 50e-6),
    # Data-centre NVMe SSD on PCIe 5.0 x4: Micron 9550 datasheet, 14,000 MB/s sequential read,
    # 10,000 MB/s sequential write, typical read latency 60 µs.
    "nvme_pcie5": TierLink("nvme_pcie5", 14.0e9, 10.0e9, 60e-6),
}
DEFAULT_DISK_LINK = "nvme_pcie4"


def tier_link(name: str, key: str, overrides: Mapping[str, Any] | None = None) -> TierLink:
    """The preset ``name`` (config key ``key``), with ``read_bw``/``write_bw``/``latency_s``
    overridden where given."""
    check_choice(key, name, LINKS)
    link = LINKS[name]
    changes = {}
    for field in ("read_bw", "write_bw", "latency_s"):
        value = (overrides or {}).get(field)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                or (value == 0 and field != "latency_s"):
            raise BadInput(f"{key}.{field} must be a number > 0, got {value!r}")
        changes[field] = float(value)
    return replace(link, **changes) if changes else link


class LoadPlanner:
    """Load times and the load-or-recompute rule for one model on one machine.

    ``pcie`` carries every load to the GPU; ``disk`` is the SSD's own link. ``recompute_s(start,
    size)`` is what prefilling ``size`` tokens after ``start`` cached ones costs the GPU.
    """

    def __init__(self, kv_bytes_per_token: int, pcie: TierLink, disk: TierLink | None,
                 recompute_s: Callable[[int, int], float], always: bool = False) -> None:
        self.kv_bytes = kv_bytes_per_token
        self.pcie, self.disk = pcie, disk
        self.recompute_s = recompute_s
        self.always = always  # load every lower-tier run, however short

    def stages(self, loaded: Mapping[str, int]) -> list[tuple[str, float]]:
        """The load's stages in order, as (copy resource, seconds): the SSD read, then PCIe."""
        host, disk = loaded.get("host", 0), loaded.get("disk", 0)
        out = []
        if disk:
            if self.disk is None:
                raise ValueError("a load from disk needs a disk link")
            out.append(("disk", self.disk.seconds(disk * self.kv_bytes)))
        if host + disk:
            out.append(("pcie", self.pcie.seconds((host + disk) * self.kv_bytes)))
        return out

    def load_seconds(self, loaded: Mapping[str, int]) -> float:
        return sum(s for _, s in self.stages(loaded))

    def write_seconds(self, tier: str, tokens: int) -> float:
        """A copy of ``tokens`` from the GPU into ``tier`` (host: PCIe; disk: PCIe, then SSD)."""
        seconds = self.pcie.seconds(tokens * self.kv_bytes, write=True)
        if tier == "disk" and self.disk is not None:
            seconds += self.disk.seconds(tokens * self.kv_bytes, write=True)
        return seconds

    def worth_loading(self, start: int, loaded: Mapping[str, int]) -> bool:
        """Load a run of ``sum(loaded)`` tokens after ``start`` GPU-cached ones, rather than
        recompute it, when the load takes less time than the prefill."""
        size = sum(loaded.values())
        if size == 0 or self.always:
            return size > 0
        return self.load_seconds(loaded) < self.recompute_s(start, size)


def prefill_compute_seconds(cost_model: RooflineCostModel) -> Callable[[int, int], float]:
    """Seconds of GPU compute ``size`` more prefill tokens after ``start`` cached ones add to a
    step: their FLOPs at the cost model's peak × MFU (in a batched prefill the weights are read
    anyway, so recomputing costs its FLOPs)."""
    peak = cost_model.hw.flops * cost_model.mfu

    def seconds(start: int, size: int) -> float:
        return cost_model.flops(StepShape(new=(max(size, 1),), context=(start,))) / peak

    return seconds


#: The host link of each ``hardware`` preset: H100 and H200 (SXM) have PCIe 5.0 x16 host
#: interfaces (NVIDIA datasheets); the A100 and A10G have PCIe 4.0 x16.
HOST_LINK_OF_HARDWARE = {"h100": "pcie5", "h200": "pcie5", "a100": "pcie4", "a10g": "pcie4"}


def make_planner(cache_cfg: Mapping[str, Any], model: ModelShape, hw: HardwareSpec) -> LoadPlanner:
    """The planner for a run: the ``cache`` group's links (``host_link``: null picks the
    hardware's own PCIe; ``disk_link``; optional ``*_link_overrides`` of ``read_bw``,
    ``write_bw``, ``latency_s``), the model's KV bytes per token on one GPU, and the roofline's
    prefill compute as the cost of recomputing (``load_back: cost``; ``always`` loads every run)."""
    mode = cache_cfg.get("load_back") or "cost"
    check_choice("cache.load_back", mode, ("cost", "always"))
    host = cache_cfg.get("host_link") or HOST_LINK_OF_HARDWARE.get(hw.name, "pcie4")
    pcie = tier_link(host, "cache.host_link", cache_cfg.get("host_link_overrides"))
    disk = None
    if cache_cfg.get("disk_tokens"):
        disk = tier_link(cache_cfg.get("disk_link") or DEFAULT_DISK_LINK, "cache.disk_link",
                         cache_cfg.get("disk_link_overrides"))
    return LoadPlanner(model.kv_bytes_per_token_per_gpu, pcie, disk,
                       prefill_compute_seconds(RooflineCostModel(model, hw)), always=mode == "always")
