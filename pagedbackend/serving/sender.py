"""The engine model's sender thread (see engine_loop.py for the threading model): the only caller
of Triton's send and of is_cancelled, and of the metrics' and info lines' IPC."""
from __future__ import annotations

import queue
import time
from typing import Any, Callable, Optional

from pagedbackend.serving.queues import take_batch
from pagedbackend.serving.responses import Outgoing, coalesce

# At most this many is_cancelled() IPC calls per poll (320/s at 50 ms): with 256 open streams
# each is asked about every 0.8 s. 64 per poll made these calls (1,280/s) outnumber the
# responses themselves under the default response budget. Requests through the ensemble are
# stopped by its stream_guard, not by this poll.
CANCEL_CHECKS_PER_POLL = 16


class Sender:
    """run() sends everything queued on `outbox` (None stops it), merged per request when
    `merge` is set (responses.coalesce); every `poll_s` it asks up to CANCEL_CHECKS_PER_POLL of
    `open_handles()` ((request id, handle) pairs, in turn) whether their client cancelled and
    hands those ids to `on_cancelled`; it pumps the metrics and passes queued `notes` to `info`."""

    def __init__(self, send: Callable[[Any, Outgoing], None], outbox: queue.SimpleQueue,
                 open_handles: Callable[[], list], on_cancelled: Callable[[str], None],
                 log: Callable[[str], None], poll_s: float, merge: bool = True,
                 metrics: Any = None, info: Optional[Callable[[str], None]] = None):
        self._send, self._outbox, self._log = send, outbox, log
        self._open_handles, self._on_cancelled = open_handles, on_cancelled
        self._poll_s, self._merge, self._metrics, self._info = poll_s, merge, metrics, info
        self.notes: queue.SimpleQueue = queue.SimpleQueue()
        self._poll_pos = 0

    def run(self) -> None:
        last_poll = time.monotonic()
        stopping = False
        while not stopping:
            # Everything queued goes out in the same pass; with merging, one response per
            # request (see coalesce()).
            batch, stopping = take_batch(self._outbox, self._poll_s)
            for item in coalesce(batch) if self._merge else batch:
                try:
                    self._send(item.handle, item)
                except Exception as e:  # noqa: BLE001 - e.g. the client went away
                    self._log(f"send failed: {type(e).__name__}: {e}")
            now = time.monotonic()
            if now - last_poll >= self._poll_s and not stopping:
                last_poll = now
                self._poll_cancels()
            if self._metrics is not None:
                self._metrics.pump()     # the metrics' IPC calls are made on this thread too
            for line in take_batch(self.notes, 0)[0]:
                try:
                    self._info(line)
                except Exception:  # noqa: BLE001
                    pass

    def _poll_cancels(self) -> None:
        handles = self._open_handles()
        if not handles:
            return
        n = min(len(handles), CANCEL_CHECKS_PER_POLL)
        start = self._poll_pos % len(handles)
        self._poll_pos = start + n
        for i in range(start, start + n):
            rid, handle = handles[i % len(handles)]
            try:
                cancelled = handle.is_cancelled()
            except Exception:  # noqa: BLE001
                cancelled = False
            if cancelled:
                self._on_cancelled(rid)      # the loop ignores ids it has already finished
