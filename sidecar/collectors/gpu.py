"""GPU metrics from NVML: utilization, memory, temperature, power and energy, clocks and why they
are held down, memory errors (ECC, retired pages, remapped rows), PCIe and NVLink health, XID
events, and the GPU memory each registered rank holds (verified ranks only: an unverified TCP
registration names whatever pid it likes, so it is attributed no GPU memory).

No NVIDIA library or driver means no GPU series and a successful collector: absent hardware is
not a failure. NVML present but broken (nvmlInit fails otherwise) is a failed run, logged once.
A lost GPU (GPU_IS_LOST, or no handle) is skipped (its `sidecar_gpu_lost` is 1) and the run
reports a partial failure while the other GPUs are exported. A field NVML does not give for a
GPU (unsupported, no permission, not ready, ...) only lacks its series, and
`sidecar_gpu_field_unavailable` says which and why. Error counters, link health and slow-moving
fields are refreshed every 10 s (nvml.HEALTH_SECONDS), the rest every collector round."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client.core import Metric

from sidecar.collectors.base import BuildContext, PartialFailure
from sidecar.collectors.gpu_events import RankGpus, memory_by_pid, owners_of, rank_gpus, start_xid_watcher
from sidecar.collectors.gpu_fitness import GpuFitness
from sidecar.collectors.gpu_metrics import (  # noqa: F401  (NAME, METRICS, FIELDS_OF and CONDITIONAL: read from here too)
    _SCALARS,
    CLOCK_EVENT,
    CLOCK_VIOLATION,
    CONDITIONAL,
    ECC_ERRORS,
    ECC_VOLATILE_ERRORS,
    FIELD_UNAVAILABLE,
    FIELDS_OF,
    INFO,
    LAST_XID,
    LAST_XID_TIME,
    LOST,
    METRICS,
    NAME,
    NVLINK_ERRORS,
    NVLINK_UP,
    PCIE_THROUGHPUT,
    PROCESS_MEMORY,
    REMAPPED_ROWS,
    REMAPPED_ROWS_FAILED,
    REMAPPED_ROWS_PENDING,
    RETIRED_PAGES,
    XID_ERRORS,
)
from sidecar.collectors.nvml import CLOCK_EVENT_REASONS, GpuLost, GpuReading, NvmlSession
from sidecar.collectors.ranktree import RankRef, RanksFn
from sidecar.collectors.xid import XidWatcher

MAX_PROBLEMS_SHOWN = 5


class GpuCollector:
    name = NAME
    metrics = METRICS

    def __init__(
        self,
        nvml_module: str,
        ranks: RanksFn,
        xid_events: bool = True,
        fitness: GpuFitness | None = None,
        live_ranks: RanksFn | None = None,
    ):
        self.session = NvmlSession(nvml_module)
        self.ranks = ranks  # the ranks /metrics shows (their GPU memory series)
        # Every live verified rank: whose processes are not left over, and the only ranks GPU
        # memory is attributed to (an unverified registration's pid may be anyone's process).
        self.live_ranks = live_ranks or ranks
        self.xid_events = xid_events
        self.xid: XidWatcher | None = None
        self.rank_gpus: RankGpus = {}  # GPUs each rank's processes held, last round
        self.fitness = fitness or GpuFitness()  # GPUs missing or held: the node verdict's GPU part
        self._memory_by_pid: dict[int, dict[str, int]] = {}

    def gpu_memory(self) -> dict[int, dict[str, int]]:
        """pid -> {gpu: bytes} of every compute process NVML listed last round."""
        return self._memory_by_pid

    def last_xids(self) -> dict[str, tuple[int, float]]:
        """gpu -> (latest XID, Unix time) since the sidecar started."""
        return self.xid.snapshot()[1] if self.xid is not None else {}

    def versions(self) -> tuple[str, str]:
        """(driver version, CUDA driver version), "" before NVML answered or without a GPU."""
        return self.session.driver_version, self.session.cuda_version

    def close(self) -> None:
        if self.xid is not None:
            self.xid.stop()
        self.session.close()

    def collect(self) -> Iterable[Metric]:
        if not self.session.start():
            self.fitness.unavailable(self.session.broken or self.session.absent or "not initialized")
            self._memory_by_pid = {}
            if self.session.broken:  # logged once by the session; the run fails until NVML works
                raise PartialFailure(self.session.broken, [])
            return []
        if self.xid_events and self.xid is None:
            self.xid = start_xid_watcher(self.session)
        readings: list[GpuReading] = []
        lost: list[str] = []
        problems: list[str] = []
        for index in range(self.session.count):
            try:
                reading = self.session.read(index)
            except GpuLost as e:
                lost.append(str(index))
                problems.append(str(e))
                continue
            readings.append(reading)
        self.session.log_field_changes()
        families = self._families(readings, lost)
        processes = [(r.gpu, r.processes) for r in readings]
        self._memory_by_pid = memory_by_pid(processes)
        self.fitness.observe(self.session.count, lost, processes, owners_of(processes, self.live_ranks))
        if problems:
            more = len(problems) - MAX_PROBLEMS_SHOWN
            raise PartialFailure(
                "; ".join(problems[:MAX_PROBLEMS_SHOWN]) + (f" (+{more} more)" if more > 0 else ""), families
            )
        return families

    def _families(self, readings: list[GpuReading], lost: list[str]) -> list[Metric]:
        info, lost_family, unavailable = INFO.family(), LOST.family(), FIELD_UNAVAILABLE.family()
        violation, ecc_volatile, pcie_throughput = (
            CLOCK_VIOLATION.family(),
            ECC_VOLATILE_ERRORS.family(),
            PCIE_THROUGHPUT.family(),
        )
        scalars = [(s.family(), attr) for s, attr in _SCALARS]
        clock, ecc, retired = CLOCK_EVENT.family(), ECC_ERRORS.family(), RETIRED_PAGES.family()
        rows, rows_pending, rows_failed = (
            REMAPPED_ROWS.family(),
            REMAPPED_ROWS_PENDING.family(),
            REMAPPED_ROWS_FAILED.family(),
        )
        nvlink_up, nvlink_errors = NVLINK_UP.family(), NVLINK_ERRORS.family()

        for gpu in lost:
            lost_family.add_metric([gpu], 1)
        for r in readings:
            g = r.gpu
            info.add_metric([g, r.uuid, r.name, r.pci_bus_id], {})
            lost_family.add_metric([g], 0)
            for name, reason in sorted(r.unavailable.items()):
                unavailable.add_metric([g, name, reason], 1.0)
            for family, attr in scalars:
                value = getattr(r, attr)
                if value is not None:
                    family.add_metric([g], float(value))
            if r.clock_event_reasons is not None:
                for reason, bit in CLOCK_EVENT_REASONS:
                    clock.add_metric([g, reason], 1.0 if r.clock_event_reasons & bit else 0.0)
            for kind, value in (("corrected", r.ecc_corrected), ("uncorrected", r.ecc_uncorrected)):
                if value is not None:
                    ecc.add_metric([g, kind], value)
            for kind, value in (("corrected", r.ecc_volatile_corrected), ("uncorrected", r.ecc_volatile_uncorrected)):
                if value is not None:
                    ecc_volatile.add_metric([g, kind], value)
            for policy, seconds in r.violation_seconds.items():
                violation.add_metric([g, policy], seconds)
            for direction, value in (("transmit", r.pcie_tx_bytes_per_second), ("receive", r.pcie_rx_bytes_per_second)):
                if value is not None:
                    pcie_throughput.add_metric([g, direction], value)
            for cause, value in (
                ("single_bit", r.retired_pages_single_bit),
                ("double_bit", r.retired_pages_double_bit),
            ):
                if value is not None:
                    retired.add_metric([g, cause], value)
            if r.remapped_rows is not None:
                correctable, uncorrectable, pending, failed = r.remapped_rows
                rows.add_metric([g, "correctable"], correctable)
                rows.add_metric([g, "uncorrectable"], uncorrectable)
                rows_pending.add_metric([g], 1.0 if pending else 0.0)
                rows_failed.add_metric([g], 1.0 if failed else 0.0)
            for link in r.nvlinks:
                if link.up is not None:
                    nvlink_up.add_metric([g, str(link.link)], 1.0 if link.up else 0.0)
                for kind, value in link.errors.items():
                    nvlink_errors.add_metric([g, str(link.link), kind], value)

        families = [
            info,
            lost_family,
            unavailable,
            *(f for f, _ in scalars),
            clock,
            violation,
            ecc,
            ecc_volatile,
            retired,
            rows,
            rows_pending,
            rows_failed,
            pcie_throughput,
            nvlink_up,
            nvlink_errors,
            *self._xid_families(),
            self._process_memory(readings),
        ]
        return [f for f in families if f.samples]

    def _xid_families(self) -> list[Metric]:
        errors, last, last_time = XID_ERRORS.family(), LAST_XID.family(), LAST_XID_TIME.family()
        if self.xid is None:
            return [errors, last, last_time]
        counts, latest = self.xid.snapshot()
        for (gpu, xid), count in sorted(counts.items()):
            errors.add_metric([gpu, xid], count)
        for gpu in self.xid.watched:
            last_xid, when = latest.get(gpu, (0, None))
            last.add_metric([gpu], last_xid)
            if when is not None:
                last_time.add_metric([gpu], when)
        return [errors, last, last_time]

    def _attributed(self) -> list[RankRef]:
        """The ranks /metrics shows that are verified: what GPU memory is attributed to."""
        verified = set(self.live_ranks())
        return [entry for entry in self.ranks() if entry in verified]

    def _process_memory(self, readings: list[GpuReading]) -> Metric:
        family = PROCESS_MEMORY.family()
        processes = [(r.gpu, r.processes) for r in readings]
        owners = owners_of(processes, self._attributed)
        self.rank_gpus = rank_gpus(processes, owners)
        for r in readings:
            per_rank: dict[tuple[str, int], int] = {}
            for pid, used in r.processes:
                owner = owners.get(pid)
                if owner is not None:
                    per_rank[owner] = per_rank.get(owner, 0) + used
            for (job_id, rank), used in sorted(per_rank.items()):
                family.add_metric([r.gpu, job_id, str(rank)], used)
        return family


def build(context: BuildContext) -> GpuCollector | None:
    """None where dcgm-exporter is the cluster's GPU source: no second NVML poller (docs/dcgm.md)."""
    cfg = context.settings.collectors
    if cfg.gpu_source != "sidecar":
        return None
    return GpuCollector(
        cfg.nvml_module,
        context.ranks,
        xid_events=cfg.xid_events,
        fitness=GpuFitness.for_settings(cfg),
        live_ranks=context.live_ranks,
    )
