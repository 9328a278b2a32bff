"""The hooks' background thread: it drains the buffer the training thread appends to, turns
records into protocol items, and posts them to the sidecar in batches.

Failure handling, in one place:
- sidecar unreachable (absent, killed, hung): the batch in flight is dropped and counted,
  the next attempt waits a capped exponential backoff, and the next contact starts with a
  fresh registration (the sidecar may have restarted and forgotten this rank). While it
  waits, records stay in the bounded buffer, which drops the oldest when full (counted).
  Its events and phases are not dropped but sent again first (`resend`, at most RESEND_ITEMS,
  the oldest dropped and counted): a step is superseded by the next one, but a lost
  `checkpoint_saved` left the sidecar naming an older checkpoint to roll back to for good (a
  sidecar that did not answer within READ_TIMEOUT under load), and a lost phase start could make
  a long checkpoint look like a stall. They go after the re-registration, first. A batch that
  did reach a sidecar too slow to answer arrives twice: the sidecar takes a checkpoint it
  has, or a phase start the same as its innermost open phase, as the same one.
- `409 unknown_rank`: re-register and resend the batch once. `409 step_not_increasing`
  (the trainer rolled its step counter back): re-register without a step, resend once.
  A batch never spans a rollback (`_take`), so at most one re-registration per rollback.
- any other 4xx: log once (rate-limited), drop that batch, carry on.
- 5xx: drop the batch and back off, as if unreachable.
- nothing to send for a while: an empty push, so that a rank that went silent (hung, or in
  a long phase) is still re-registered with a sidecar that restarted meanwhile.
- a step whose CUDA values the GPU has not computed yet: the batch ends before it, it stays
  first in the buffer, the thread looks again every GPU_POLL_SECONDS (empty pushes go on);
  gpu_values.py reads it once computed.

A re-registration carries the last step and phase the sidecar acknowledged, so a restarted
sidecar resumes watching the rank instead of giving it a fresh start-up budget; the batches
that follow bring it up to date in order.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from trainer_hooks import collectives, distributed, ending
from trainer_hooks.environment import Endpoint, Identity, versions
from trainer_hooks.errors import warn
from trainer_hooks.gpu_values import GpuReader, pop_ready
from trainer_hooks.jobview import CoordinatorExchange
from trainer_hooks.pauses import CHECK_SECONDS, Inference
from trainer_hooks.records import Encoder
from trainer_hooks.stacks import StackDump
from trainer_hooks.transport import CONNECT_TIMEOUT, READ_TIMEOUT, Reply, Unreachable, post
from trainer_hooks.wire import JOB_KEY_CHARS, KEEPALIVE_SECONDS, OBSERVE_ONLY, RESTART_SAFE, WANTS

HOOKS_VERSION = "0.1.0"
BATCH_ITEMS = 1000  # ~200 KiB of JSON for step items: well under the sidecar's 1 MiB body limit
MAX_BACKOFF_SECONDS = 5.0  # a restarted sidecar hears from every rank within this long
# KEEPALIVE_SECONDS (wire.py): with nothing to send for this long, an empty push asks the sidecar
# whether it still knows the rank: a rank that hangs (or sits in a long phase) sends nothing, and
# must still be re-registered with a restarted sidecar so that its watchdog can see the hang.
# Encoding is Python code holding the GIL; a hook call arriving meanwhile would wait for it
# (up to the 5 ms switch interval). Yielding every few records keeps that wait short.
YIELD_EVERY = 64
# While the oldest record waits for the GPU to compute its values, the thread looks again this often
# (a cudaEventQuery each time), not at the flush interval.
GPU_POLL_SECONDS = 0.02
RESEND_ITEMS = 64  # events and phases of unanswered batches kept to send again (a sidecar outage's worth)
CLOSE_GPU_SHARE = 0.5  # of what is left of a close's budget, the most spent waiting for GPU values
_MIN_SERVER_INTERVAL, _MAX_SERVER_INTERVAL = 0.05, 60.0


def _dumps(body: dict) -> bytes:
    # allow_nan=False: the records module already turned non-finite numbers into strings;
    # this makes sure nothing non-strict ever reaches the wire.
    return json.dumps(body, allow_nan=False, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Tuning:
    """How the sender talks to the sidecar: per-request timeouts and the longest backoff (in
    seconds), the most items in one batch, and the silence after which it sends an empty push."""

    connect_timeout: float = CONNECT_TIMEOUT
    read_timeout: float = READ_TIMEOUT
    max_backoff: float = MAX_BACKOFF_SECONDS
    batch_items: int = BATCH_ITEMS
    keepalive: float = KEEPALIVE_SECONDS


@dataclass(eq=False, repr=False)
class Sender:
    """The sender thread's inputs; its own state is set up in __post_init__. `flush_interval`
    changes when `adopt_server_interval` lets the sidecar's registration answer set it."""

    buffer: deque
    endpoint: Endpoint
    ident: Identity
    pid: int
    stack_dump: StackDump | None
    flush_interval: float
    adopt_server_interval: bool
    tuning: Tuning = field(default_factory=Tuning)

    def __post_init__(self) -> None:
        self.encoder = Encoder()
        self.gpu = GpuReader(self.encoder)  # steps with CUDA values (gpu_values.py)
        self.registered = False
        self.registrations = 0
        self.sent = 0  # items the sidecar accepted
        self.lost = 0  # records dropped: buffer overflow seen so far, failed batches
        self.cpu_seconds = 0.0  # CPU time this thread spent (what the hooks cost beyond the calls)
        self._cpu_mark = 0.0
        self._expected_seq = 0  # seq of the next record; a higher one means the buffer dropped some
        self._acked_step: int | None = None
        self._acked_phases: list[tuple[str, float | None]] = []  # (name, timeout_seconds)
        self._held_back: dict | None = None  # a rolled-back step item that starts the next batch
        self._backoff = 0.0
        self.session: str | None = None  # returned by the registration
        self._retry_at = 0.0
        self._last_contact = 0.0  # monotonic time of the last answered request
        self._wake = threading.Event()
        self._close_deadline: float | None = None
        self._close_reason = "finished"
        self._close_exit: dict | None = None  # the exception the rank dies of (exits.py)
        self.thread: threading.Thread | None = None
        # Items the hooks' own helpers add (the job view's coordinator, jobview.py), sent first.
        self.extra: deque[dict] = deque(maxlen=16)
        self.resend: deque[dict] = deque()  # events and phases of batches the sidecar did not answer
        self.job_view_enabled = True  # Monitor: SIDECAR_JOB_VIEW
        self.job_view_offer: dict | None = None  # the sidecar's offer to coordinate the job (rank 0's)
        self.exit = os._exit  # how the job ends when the sidecar ends it (ending.py)
        self.job_view: CoordinatorExchange | None = None
        # The rank's Flight Recorder summary (collectives.py) goes with a push at most every
        # READ_EVERY_SECONDS, and with the next push at once when the sidecar's answer asks.
        self.collectives_enabled = True  # Monitor: SIDECAR_COLLECTIVES
        self.collectives_read_at = -1e9  # monotonic
        self.collectives_live = False  # the last read gave a record (a group with the recorder exists)
        self.collectives_cpu_seconds = 0.0  # this thread's CPU time in reading the record
        self.wants: set[str] = set()  # what the sidecar's last answer asked for (wire.WANTS)
        self.clock_offset = 0.0  # this node's clock - its job's coordinator's, as the sidecar last said
        # The phases the hooks infer (pauses.py): polled every cycle, and the thread wakes when a
        # pause becomes one, so that its start reaches the sidecar within a second or so.
        self.pauses: Inference | None = None
        self._gpu_wait = False  # the last _take stopped before a record whose GPU values are not computed
        self._gpu_poll = False  # ... and nothing could go: _sleep looks again after GPU_POLL_SECONDS

    # ---------------------------------------------------------------- thread life

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="trainer_hooks-sender", daemon=True)
        self.thread.start()

    def stop(self, budget: float, reason: str, exit_report: dict | None = None) -> None:
        """Ask for a last flush and a deregistration within `budget` seconds, and wait at most
        that long (plus a little): a hung sidecar cannot hold up the training process's exit."""
        self._close_reason = reason
        self._close_exit = exit_report
        self._close_deadline = time.monotonic() + budget
        if self.job_view is not None:
            self.job_view.stop()
        self._wake.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(budget + 0.2)

    def wake(self) -> None:
        """Send what is buffered now, not at the next flush (from any thread; an Event.set)."""
        self._wake.set()

    def _sleep(self) -> None:
        """Until woken or the flush interval has passed (GPU_POLL_SECONDS while the oldest record
        waits for its GPU values and nothing else could go). With phases to infer (pauses.py) it
        looks at their flags every CHECK_SECONDS, and again at the moment a pause becomes a phase,
        whose start then goes at once: about INFER_AFTER_SECONDS into the pause, whatever the
        flush interval."""
        interval = GPU_POLL_SECONDS if self._gpu_poll else self.flush_interval
        pauses = self.pauses
        if pauses is None:
            self._wake.wait(interval)
            return
        deadline = time.monotonic() + interval
        while (left := deadline - time.monotonic()) > 0:
            due = pauses.due_in()
            if self._wake.wait(min(left, CHECK_SECONDS if due is None else due)) or pauses.poll(install=False):
                return

    def _run(self) -> None:
        while True:
            self._sleep()
            self._wake.clear()  # a close sets it again after setting its deadline, read below
            if os.getpid() != self.pid:  # a forked child never speaks for the rank
                return
            self._cpu_mark = time.thread_time()
            try:
                if self._close_deadline is not None:
                    self.cycle(self._close_deadline, final=True)
                    if self.registered:
                        self.deregister(self._close_reason, self._close_deadline)
                    return
                if self.pauses is not None:
                    self.pauses.poll()
                self.cycle()
            except Exception as e:  # the thread must outlive any bug of its own
                warn("sender_error", "trainer_hooks: sender error (%s: %s); continuing", type(e).__name__, e)
                self._failed()
            finally:
                self._account_cpu()

    def _account_cpu(self) -> None:
        now = time.thread_time()
        self.cpu_seconds += now - self._cpu_mark
        self._cpu_mark = now

    # ---------------------------------------------------------------- one round

    def dropped(self) -> int:
        """Records lost so far: counted ones plus those the buffer dropped since the last take."""
        try:
            oldest = self.buffer[0][0]
        except IndexError:
            return self.lost
        return self.lost + max(0, oldest - self._expected_seq)

    def cycle(self, deadline: float | None = None, final: bool = False) -> None:
        """Register if needed, then send everything buffered, a batch at a time, up to a step whose
        GPU values are not computed yet (it goes with a later cycle; a close reads it anyway)."""
        self._gpu_poll = False
        if not final and time.monotonic() < self._retry_at:
            return
        if not self.registered and not self.register(deadline):
            self._failed()
            return
        quiet = time.monotonic() - self._last_contact >= self.tuning.keepalive
        # A rank waiting in a collective has nothing else to send: its record goes alone, so that the
        # sidecar sees it enter a collective within a second and knows it still lives.
        due = self.collectives_live and time.monotonic() - self.collectives_read_at >= collectives.READ_EVERY_SECONDS
        idle = not self.buffer and not final and not self.extra and not self.resend and self._held_back is None
        if idle and (quiet or self.wants or due):
            self._send([], deadline)
            return
        if final and deadline is not None:
            self.gpu.deadline = time.monotonic() + max(0.0, deadline - time.monotonic()) * CLOSE_GPU_SHARE
        sent = False
        while self.buffer or self._held_back is not None or self.extra or self.resend:
            if deadline is not None and time.monotonic() >= deadline:
                return
            self._gpu_wait = False
            items = self._take(final)
            if items:
                if not self._send(items, deadline):
                    return
                sent = True
            self._account_cpu()
            if self._gpu_wait:
                # When some records went, the one waiting goes with the next flush, like those behind
                # it. When none could, look again soon, and let the sidecar hear from the rank meanwhile.
                if not sent:
                    self._gpu_poll = True
                    if quiet or self.wants or due:
                        self._send([], deadline)
                break
        self._backoff = 0.0

    def _take(self, final: bool = False) -> list[dict]:
        """The next batch. A batch ends before a step that does not increase (the trainer
        rolled back): the sidecar refuses such a batch whole, while a batch that starts with
        the rollback only needs a re-registration. It also ends before a step whose GPU values
        are not computed yet (`_gpu_wait`), except in a close (`final`)."""
        items: list[dict] = []
        while self.resend and len(items) < self.tuning.batch_items:  # older than anything still to go
            items.append(self.resend.popleft())
        while self.extra:
            items.append(self.extra.popleft())
        last_step = None
        if self._held_back is not None:
            items.append(self._held_back)
            last_step, self._held_back = self._held_back["step"], None
        buffer, encode, batch_items = self.buffer, self.encoder.item, self.tuning.batch_items
        while buffer and len(items) < batch_items:
            if len(items) % YIELD_EVERY == YIELD_EVERY - 1:
                time.sleep(0)  # let the training thread have the GIL
            record = pop_ready(buffer, final)
            if record is None:
                self._gpu_wait = True
                break
            seq = record[0]
            if seq >= self._expected_seq:
                self.lost += seq - self._expected_seq  # the buffer dropped the ones in between
                self._expected_seq = seq + 1
            else:  # two threads appended out of numbering order: counted lost above, it is not
                self.lost -= 1
            try:
                item = encode(record) if len(record) < 6 else self.gpu.item(record, final)
            except Exception as e:
                warn(
                    f"encode:{type(e).__name__}",
                    "trainer_hooks: cannot encode a %s record (%s: %s); dropped",
                    record[1],
                    type(e).__name__,
                    e,
                )
                item = None
            if item is None:
                self.lost += 1
                continue
            if item["type"] == "step":
                if last_step is not None and item["step"] <= last_step:
                    self._held_back = item
                    break
                last_step = item["step"]
            items.append(item)
        return items

    def _send(self, items: list[dict], deadline: float | None) -> bool:
        """Push one batch; False when the round should stop (sidecar unreachable)."""
        reply = self._post("/v1/push", self._push_body(items), deadline)
        if reply is not None and reply.status == 409 and reply.code in ("unknown_rank", "step_not_increasing"):
            self.registered = False
            if not self.register(deadline, with_step=reply.code == "unknown_rank"):
                self._unanswered(items)
                self._failed()
                return False
            reply = self._post("/v1/push", self._push_body(items), deadline)
        if reply is None or reply.status >= 500:
            self._unanswered(items)
            self.registered = False
            self._failed()
            return False
        self._last_contact = time.monotonic()
        if reply.status == 200:
            ending.obey(reply.body, self.ident, self.exit)
            self._acknowledge(items)
            self._take_wants(reply.body.get("want"))
            self.clock_offset = collectives.clock_offset(reply.body.get("clock_offset"), self.clock_offset)
            return True
        warn(
            f"push:{reply.status}:{reply.code}",
            "trainer_hooks: sidecar rejected a batch of %d items (%d %s); dropped",
            len(items),
            reply.status,
            reply.error,
        )
        self._lose(items)
        return True

    def _push_body(self, items: list[dict]) -> bytes:
        body = {
            "job_id": self.ident.job_id,
            "rank": self.ident.rank,
            "pid": self.pid,
            "dropped": self.dropped(),
            "items": items,
            "session": self.session,
        }
        if self.collectives_enabled:
            self._add_collectives(body)
        return _dumps(body)

    def _add_collectives(self, body: dict) -> None:
        """The rank's collective record (and its whole Flight Recorder dump when asked) with this
        push. A torch without the recorder, or any error reading it, costs this push nothing."""
        wants, self.wants = self.wants, set()
        now = time.monotonic()
        if "collectives" not in wants and now - self.collectives_read_at < collectives.READ_EVERY_SECONDS:
            return
        mark = time.thread_time()
        try:
            record = collectives.read(whole="collectives" in wants, clock_offset=self.clock_offset)
            self.collectives_read_at, self.collectives_live = now, record is not None
            if record is not None:
                body["collectives"] = record
            if "fr_dump" in wants:
                trace = collectives.dump_json()
                if trace is not None:
                    body["fr_dump"] = trace
        except Exception as e:
            warn("collectives", "trainer_hooks: cannot read the Flight Recorder (%s: %s)", type(e).__name__, e)
            self.collectives_read_at, self.collectives_live = now, False
        finally:
            self.collectives_cpu_seconds += time.thread_time() - mark

    def _take_wants(self, want: object) -> None:
        """The sidecar asks for a fresh collective record (a rank of this job turned suspect) or
        the whole Flight Recorder dump (an incident): sent with the next push, at once."""
        if isinstance(want, list):
            asked = {w for w in want if isinstance(w, str) and w in WANTS}
            if asked and self.collectives_enabled:
                self.wants |= asked
                self._wake.set()

    def _lose(self, items: list[dict]) -> None:
        self.lost += len(items)

    def _unanswered(self, items: list[dict]) -> None:
        """A batch the sidecar did not answer: its steps are lost (counted), its events and phases
        are sent again first, in their order (the oldest beyond RESEND_ITEMS lost)."""
        keep = [item for item in items if item["type"] in ("event", "phase")]
        self.lost += len(items) - len(keep)
        self.resend.extendleft(reversed(keep))  # before any kept from an earlier failure: they are newer
        while len(self.resend) > RESEND_ITEMS:
            self.resend.popleft()
            self.lost += 1

    def _acknowledge(self, items: list[dict]) -> None:
        self.sent += len(items)
        for item in items:
            kind = item["type"]
            if kind == "step":
                self._acked_step = item["step"]
            elif kind == "phase":
                name = item["name"]
                if item["action"] == "start":
                    self._acked_phases.append((name, item.get("timeout_seconds")))
                else:
                    names = [n for n, _ in self._acked_phases]
                    if name in names:
                        del self._acked_phases[len(names) - 1 - names[::-1].index(name)]
        self._backoff = 0.0

    def _failed(self) -> None:
        self._backoff = min(self.tuning.max_backoff, max(self.flush_interval, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff * random.uniform(0.8, 1.2)

    # ---------------------------------------------------------------- requests

    def register(self, deadline: float | None = None, with_step: bool = True) -> bool:
        body = {
            "job_id": self.ident.job_id,
            "rank": self.ident.rank,
            "local_rank": self.ident.local_rank,
            "world_size": self.ident.world_size,
            "local_world_size": self.ident.local_world_size,
            "restart_count": self.ident.restart_count,
            "pid": self.pid,
            "step": self._acked_step if with_step else None,
            "phase": self._acked_phases[-1][0] if self._acked_phases else None,
            # A restarted sidecar must judge the phase by the rank's own budget, not its default.
            "phase_timeout_seconds": self._acked_phases[-1][1] if self._acked_phases else None,
            "versions": versions(),
            "stack_dump": self.stack_dump.as_wire() if self.stack_dump else None,
            "hooks_version": HOOKS_VERSION,
            "launcher": self.ident.launcher.as_wire(),
            RESTART_SAFE: distributed.restart_safety(),
        }
        if self.ident.kubernetes:
            body["kubernetes"] = dict(self.ident.kubernetes)
        if self.ident.slurm is not None:
            body["slurm"] = dict(self.ident.slurm)  # protocol 9: its Slurm job's account and partition
        if self.ident.observe_only:
            body[OBSERVE_ONLY] = True  # protocol 6: never kill this job's ranks, only report their stalls
        reply = self._post("/v1/register", _dumps(body), deadline)
        if reply is None:
            return False
        if reply.status != 200:
            warn(
                f"register:{reply.status}:{reply.code}",
                "trainer_hooks: sidecar refused registration of %s rank %d (%d %s); will retry",
                self.ident.job_id,
                self.ident.rank,
                reply.status,
                reply.error,
            )
            return False
        ending.obey(reply.body, self.ident, self.exit)
        self.registered = True
        session = reply.body.get("session")
        self.session = session if isinstance(session, str) else None  # proves who we are over TCP
        self.registrations += 1
        self._last_contact = time.monotonic()
        dump = reply.body.get("stack_dump")
        if self.stack_dump is not None and isinstance(dump, dict) and isinstance(dump.get("path"), str):
            self.stack_dump.adopt(dump["path"])
        interval = reply.body.get("flush_interval_s")
        if self.adopt_server_interval and isinstance(interval, (int, float)) and not isinstance(interval, bool):
            self.flush_interval = min(_MAX_SERVER_INTERVAL, max(_MIN_SERVER_INTERVAL, float(interval)))
        offer = reply.body.get("job_view")
        if isinstance(offer, dict) and isinstance(offer.get("url"), str) and isinstance(offer.get("node"), str):
            self.job_view_offer = {"url": offer["url"], "node": offer["node"]}
            key = offer.get("key")
            if isinstance(key, str) and len(key) == JOB_KEY_CHARS:
                self.job_view_offer["key"] = key  # the job's key, published with the offer (protocol 6)
        if self.job_view is None and self.job_view_enabled and self.ident.world_size > 1:
            self.job_view = CoordinatorExchange(self.ident.rank, lambda: self.job_view_offer, self._add_item)
            self.job_view.start()
        return True

    def _add_item(self, item: dict) -> None:
        self.extra.append({**item, "time": time.time()})  # goes out with the next flush

    def deregister(self, reason: str, deadline: float | None = None) -> None:
        body = {
            "job_id": self.ident.job_id,
            "rank": self.ident.rank,
            "pid": self.pid,
            "reason": reason,
            "session": self.session,
        }
        if self._close_exit is not None:
            body["exit"] = self._close_exit
        reply = self._post("/v1/deregister", _dumps(body), deadline)
        if reply is not None and reply.status == 200:
            self.registered = False

    def _post(self, path: str, body: bytes, deadline: float | None) -> Reply | None:
        """The reply, or None when the sidecar is unreachable or the deadline leaves no time."""
        connect_timeout, read_timeout = self.tuning.connect_timeout, self.tuning.read_timeout
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0.01:
                return None
            connect_timeout, read_timeout = min(connect_timeout, left), min(read_timeout, left)
        try:
            return post(self.endpoint, path, body, connect_timeout, read_timeout)
        except Unreachable as e:
            warn(
                "unreachable",
                "trainer_hooks: sidecar unreachable (%s); records are buffered and the oldest dropped when full",
                e,
            )
            return None
