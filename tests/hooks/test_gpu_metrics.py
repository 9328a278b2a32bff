"""Steps with CUDA tensors, without a GPU: the training thread records a readiness marker (a CUDA
event, faked here), and the sender reads and sends such a step only once the marker says the GPU
has computed its values, keeping up its empty pushes meanwhile; a close reads them anyway, or
sends the step without them when the GPU never gets there. CPU values never make a marker."""

from __future__ import annotations

import dataclasses
import http.server
import json
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import trainer_hooks.monitor as monitor_module
from tests.support import wait_until
from trainer_hooks import Monitor
from trainer_hooks.records import STEP

KEEPALIVE = 0.2  # the sender's silence before an empty push, shortened for these tests


class FakeSidecar:
    """Answers the hooks on a Unix socket as a sidecar that accepts everything, and keeps what
    they sent: `pushes` (each push's items, in order), `registrations`, `deregistrations`."""

    def __init__(self, path: Path):
        self.path = str(path)
        self.pushes: list[list[dict]] = []
        self.registrations = 0
        self.deregistrations: list[dict] = []
        self._lock = threading.Lock()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake._lock:
                    if self.path == "/v1/register":
                        fake.registrations += 1
                    elif self.path == "/v1/push":
                        fake.pushes.append(body["items"])
                    elif self.path == "/v1/deregister":
                        fake.deregistrations.append(body)
                data = json.dumps({"session": "s"}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = socketserver.ThreadingUnixStreamServer(self.path, Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def steps(self) -> list[dict]:
        """The step items pushed so far, in order."""
        with self._lock:
            return [item for push in self.pushes for item in push if item["type"] == "step"]

    def keepalives(self) -> int:
        with self._lock:
            return sum(1 for push in self.pushes if not push)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def fake_sidecar(tmp_path: Path) -> Iterator[FakeSidecar]:
    fake = FakeSidecar(tmp_path / "sidecar.sock")
    try:
        yield fake
    finally:
        fake.close()


class FakeCudaTensor:
    """What the hooks see of a CUDA tensor: `is_cuda`, `device`, `detach()`, `item()`. Reads are
    counted, and so are those made while `marker` (when set) said the GPU had not computed it."""

    is_cuda = True
    device = "cuda:0"

    def __init__(self, value: float):
        self.value = value
        self.reads = 0
        self.early_reads = 0
        self.marker: FakeMarker | None = None

    def detach(self) -> FakeCudaTensor:
        return self

    def item(self) -> float:
        self.reads += 1
        if self.marker is not None and not self.marker.done:
            self.early_reads += 1
        return self.value


class FakeCpuTensor(FakeCudaTensor):
    is_cuda = False
    device = "cpu"


class FakeMarker:
    """A CUDA event as the sender sees it: `query()` is True once `done` is."""

    def __init__(self, device: Any):
        self.device = device
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


@pytest.fixture
def markers(monkeypatch: pytest.MonkeyPatch) -> list[FakeMarker]:
    """The markers the training thread made, in order (monitor._gpu_marker faked)."""
    made: list[FakeMarker] = []

    def fake_marker(device: Any) -> FakeMarker:
        made.append(FakeMarker(device))
        return made[-1]

    monkeypatch.setattr(monitor_module, "_gpu_marker", fake_marker)
    return made


def live_monitor(fake: FakeSidecar, flush_interval: float = 0.05) -> Monitor:
    """A monitor pushing to `fake`, with an empty push after KEEPALIVE of silence."""
    mon = Monitor(
        job_id="gpu",
        rank=0,
        world_size=1,
        socket=fake.path,
        flush_interval=flush_interval,
        stack_signal=None,
        environ={"SIDECAR_INFER_PHASES": "0", "SIDECAR_COLLECTIVES": "0"},
    )
    assert mon._sender is not None
    mon._sender.tuning = dataclasses.replace(mon._sender.tuning, keepalive=KEEPALIVE)
    wait_until(lambda: mon.registered, 10, interval=0.01, what="registration")
    return mon


def sent_steps(fake: FakeSidecar) -> list[tuple[int, dict]]:
    return [(item["step"], item["metrics"]) for item in fake.steps()]


def test_a_step_whose_gpu_values_are_not_computed_is_neither_read_nor_sent_and_keepalives_go(
    fake_sidecar: FakeSidecar, markers: list[FakeMarker]
):
    mon = live_monitor(fake_sidecar, flush_interval=0.5)
    try:
        mon.step(1, loss=1.0)
        wait_until(lambda: sent_steps(fake_sidecar) == [(1, {"loss": 1.0})], 10, interval=0.01, what="step 1")
        loss = FakeCudaTensor(2.5)
        mon.step(2, loss=loss, lr=0.1)
        mon.step(3, loss=0.5)  # a CPU step behind it waits too: the order is kept
        assert len(markers) == 1, "one marker for the step with a CUDA value"
        keepalives = fake_sidecar.keepalives()
        time.sleep(6 * KEEPALIVE)
        assert loss.reads == 0, "the sender read a value the GPU had not computed"
        assert sent_steps(fake_sidecar) == [(1, {"loss": 1.0})], "a step was sent before its GPU values were computed"
        empty = fake_sidecar.keepalives() - keepalives
        assert 3 <= empty <= 8, f"{empty} empty pushes in {6 * KEEPALIVE:.1f} s while a step waited (one a KEEPALIVE)"
        # It looks again soon (GPU_POLL_SECONDS: about 60 times here), not once a flush interval
        # (twice), nor in a busy loop.
        assert 20 <= markers[0].queries <= 200, f"{markers[0].queries} queries in {6 * KEEPALIVE:.1f} s"
        assert mon.dropped == 0
    finally:
        for m in markers:
            m.done = True
        mon.close()


def test_once_computed_the_step_goes_with_its_values_in_order_and_the_records_behind_it_follow(
    fake_sidecar: FakeSidecar, markers: list[FakeMarker]
):
    mon = live_monitor(fake_sidecar)
    try:
        loss, grad_norm = FakeCudaTensor(2.5), FakeCudaTensor(0.75)
        mon.step(1, loss=1.0)
        mon.step(2, loss=loss, grad_norm=grad_norm, lr=0.1)
        loss.marker = grad_norm.marker = markers[0]
        mon.step(3, loss=0.5)
        mon.event("checkpoint_saved", step=3)
        mon.step(4, loss=FakeCudaTensor(0.25))
        assert [m.device for m in markers] == ["cuda:0", "cuda:0"], "one marker per step with CUDA values"
        wait_until(lambda: sent_steps(fake_sidecar), 10, interval=0.01, what="step 1")
        time.sleep(0.3)
        assert sent_steps(fake_sidecar) == [(1, {"loss": 1.0})]
        markers[0].done = True
        wait_until(lambda: len(sent_steps(fake_sidecar)) >= 3, 10, interval=0.01, what="steps 2 and 3")
        time.sleep(0.3)
        assert sent_steps(fake_sidecar) == [
            (1, {"loss": 1.0}),
            (2, {"loss": 2.5, "grad_norm": 0.75, "lr": 0.1}),
            (3, {"loss": 0.5}),
        ], "step 4 waits for its own marker"
        assert (loss.reads, grad_norm.reads) == (1, 1)
        assert loss.early_reads == grad_norm.early_reads == 0
        events = [item["name"] for push in fake_sidecar.pushes for item in push if item["type"] == "event"]
        assert events == ["checkpoint_saved"]
        markers[1].done = True
        wait_until(lambda: len(sent_steps(fake_sidecar)) == 4, 10, interval=0.01, what="step 4")
        assert sent_steps(fake_sidecar)[3] == (4, {"loss": 0.25})
        # the sender counts a push once the sidecar answered it: a moment after the sidecar has it
        wait_until(lambda: mon.sent == 5, 10, interval=0.01, what="the last push counted")
        assert mon.dropped == 0
    finally:
        for m in markers:
            m.done = True
        mon.close()


def test_cpu_values_make_no_marker_and_keep_the_five_element_record(tmp_path: Path, markers: list[FakeMarker]):
    mon = Monitor(job_id="unit", rank=0, world_size=1, environ={}, socket=str(tmp_path / "absent.sock"))
    try:

        class Anything:
            """An object that answers every attribute (a mock): not taken for a CUDA tensor."""

            def __getattr__(self, name: str) -> Any:
                return lambda *a: 1.0

        mon.step(1, loss=2.3, tokens=7, flag=True, skipped=None, name="x")
        mon.step(2, loss=FakeCpuTensor(1.0), other=Anything())
        mon.step(3.0, loss=1.0)  # a step that is no int is looked at too
        mon.step(FakeCpuTensor(4.0))
        assert markers == [], "a CPU-only step made a GPU marker"
        assert [len(r) for r in mon._buffer] == [5, 5, 5, 5]
        mon.step(5, loss=1.0, grad_norm=FakeCudaTensor(1.0))
        mon.step(FakeCudaTensor(6.0))  # a step number on the GPU is waited for too
        assert [len(r) for r in mon._buffer][-2:] == [6, 6] and len(markers) == 2
        assert all(r[1] == STEP for r in mon._buffer)
    finally:
        for m in markers:
            m.done = True
        mon.close(timeout=0.2)


def test_a_marker_that_fails_leaves_the_step_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    def broken(device: Any) -> Any:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(monitor_module, "_gpu_marker", broken)
    mon = Monitor(job_id="unit", rank=0, world_size=1, environ={}, socket=str(tmp_path / "absent.sock"))
    try:
        mon.step(1, loss=FakeCudaTensor(1.0))
        assert [len(r) for r in mon._buffer] == [5], "the step is kept, unmarked"
    finally:
        mon.close(timeout=0.2)


def test_a_marker_whose_query_raises_counts_as_computed(fake_sidecar: FakeSidecar, markers: list[FakeMarker]):
    mon = live_monitor(fake_sidecar)
    try:
        loss = FakeCudaTensor(2.5)
        mon.step(1, loss=loss)

        def raises() -> bool:
            raise RuntimeError("CUDA error")

        markers[0].query = raises  # type: ignore[method-assign]
        wait_until(lambda: sent_steps(fake_sidecar) == [(1, {"loss": 2.5})], 10, interval=0.01, what="step 1")
        assert loss.reads == 1
    finally:
        mon.close()


def test_close_reads_the_gpu_values_still_pending(fake_sidecar: FakeSidecar, markers: list[FakeMarker]):
    mon = live_monitor(fake_sidecar)
    loss = FakeCudaTensor(2.5)
    mon.step(1, loss=loss)
    loss.marker = markers[0]
    mon.step(2, loss=0.5)
    time.sleep(0.2)
    assert sent_steps(fake_sidecar) == [] and loss.reads == 0
    threading.Timer(0.1, lambda: setattr(markers[0], "done", True)).start()  # the GPU gets there during the close
    mon.close()
    assert sent_steps(fake_sidecar) == [(1, {"loss": 2.5}), (2, {"loss": 0.5})]
    assert (loss.reads, loss.early_reads) == (1, 0), "read once, after the GPU had computed it"
    assert len(fake_sidecar.deregistrations) == 1


def test_close_sends_the_step_without_the_values_a_gpu_never_computes(
    fake_sidecar: FakeSidecar, markers: list[FakeMarker]
):
    mon = live_monitor(fake_sidecar)
    loss = FakeCudaTensor(2.5)
    mon.step(1, loss=loss, lr=0.1)
    mon.step(2, loss=0.5)
    start = time.monotonic()
    mon.close(timeout=0.8)
    took = time.monotonic() - start
    assert took < 1.0, f"close took {took:.2f} s"
    assert loss.reads == 0, "a value the GPU never computed was read"
    assert sent_steps(fake_sidecar) == [(1, {"lr": 0.1}), (2, {"loss": 0.5})]
    assert len(fake_sidecar.deregistrations) == 1, "the deregistration must not wait for the GPU"
