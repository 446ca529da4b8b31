"""The engine model's threads: one loop thread owns the LLMEngine, one sender thread (sender.py) is
the only caller of Triton's send and of is_cancelled. Free of Triton imports, so it is unit-tested
with a fake engine and fake senders.

Threading model:
- `submit()` / `reject()` run on Triton's execute thread; they only enqueue, after compiling a
  structured-output grammar (the engine's GrammarCompiler is thread-safe; the loop then finds
  it in the cache).
- The loop thread alone calls the engine (add_request, step, abort, stats) and alone owns `_live`
  (per-request state); it turns engine outputs into `Outgoing` items on the outbox.
- The sender thread alone calls `send(handle, outgoing)`; it sends exactly one final per request,
  because only the loop (or, once the loop is dead, `submit`) creates final items, once each.
- The sender takes everything queued at once and merges each request's chunks into one response
  (`responses.coalesce`), so a sender that falls behind sends fewer, larger responses instead of a
  backlog.
- With `max_responses_per_s` the loop itself holds back streamed steps so that all requests
  together send about that many responses per second (each request every len(live) / rate seconds;
  the first token and the final go at once). Every response costs an IPC round trip in each Python
  model of the ensemble, and that chain, not the engine, limited W4 on the H200.
- Between sends, every `cancel_poll_s`, the sender thread also calls `handle.is_cancelled()` (stub
  IPC, slow) on up to sender.CANCEL_CHECKS_PER_POLL unfinished requests in turn and hands cancelled
  ids to the loop, which aborts them before its next step. All stub IPC stays on one thread, and a
  handle whose final response has gone out is never asked again (its rid has left `_handles` before
  its final is queued). An earlier design polled every live request from its own thread every 50
  ms; under W4 load on the H200 (hundreds of live streams) that was ~10k IPC calls/s racing the
  sends, and tritonserver died of heap corruption.
- Through the ensemble a client's cancel never reaches the engine's request (Triton 2.51 cancels
  only the ensemble steps scheduled after it), so stream_guard, which runs on each response,
  stops it. A streamed request still waiting for its first token sends no response, so with
  `queued_probe_s` the loop sends it an empty one (no token, no text) every that many seconds:
  the guard step it schedules sees a cancel, and a client that left while queued leaves the
  queue within about that time instead of holding its slot until it is scheduled.
- `_handles` (request id -> (handle, key), read by the sender's polls through `_open_handles`) and
  `_keys` (request key -> request id, read by `stop()`) are the only state under a lock.
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
import traceback
from typing import Any, Callable, Optional

from pagedbackend.serving.admission import Admission, AdmissionConfig
from pagedbackend.serving.beam_requests import BeamRequests
from pagedbackend.serving.busy_period import BusyPeriod
from pagedbackend.serving.live_request import LiveRequest
from pagedbackend.serving.queues import take_batch
from pagedbackend.serving.request import ParsedRequest
from pagedbackend.serving.responses import Chunk, Outgoing, last_logprobs, merge_chunks
from pagedbackend.serving.sender import Sender

from pagedbackend.engine.detokenizer import DETOKENIZE_CONTEXT, MAX_EXTRA_CONTEXT, context_for

# Ids kept per request so context_for can start the detokenizer's context on a clean boundary.
_TAIL = DETOKENIZE_CONTEXT + MAX_EXTRA_CONTEXT


class EngineLoop:
    def __init__(self, engine: Any, send: Callable[[Any, Outgoing], None], metrics: Any = None,
                 log: Callable[[str], None] = print, on_dead: Optional[Callable[[], None]] = None,
                 cancel_poll_s: float = 0.05, stats_period_s: float = 0.5,
                 coalesce: bool = True, max_responses_per_s: float = 0.0,
                 info: Optional[Callable[[str], None]] = None,
                 admission: AdmissionConfig = AdmissionConfig(), queued_probe_s: float = 0.0):
        self.engine, self.metrics, self._log = engine, metrics, log
        self._probe_s, self._next_probe = queued_probe_s, 0.0
        # info: called on the sender thread (stub IPC stays there) with one line per busy
        # period (busy_period.py)
        self._info = info
        # > 0: streamed responses of all requests together stay near this rate; each request
        # then sends every len(live) / rate seconds, its steps merged (first and last at once).
        self._max_rate = max_responses_per_s
        self._on_dead = on_dead
        self._stats_period_s = stats_period_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._cancels: queue.SimpleQueue = queue.SimpleQueue()
        self._admission = Admission(admission, self._inbox)     # admission.py
        self._live: dict[str, LiveRequest] = {}
        self._beams = BeamRequests(engine, log)          # requests with beam_width > 1
        self._handles: dict[str, tuple[Any, str]] = {}
        self._keys: dict[str, str] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._dead = threading.Event()
        self._sender = Sender(send, self._outbox, self._open_handles, self._cancels.put, log,
                              cancel_poll_s, coalesce, metrics, info)
        self._threads = [threading.Thread(target=t, name=n, daemon=True) for t, n in (
            (self._run, "engine-loop"), (self._sender.run, "engine-sender"))]

    # ---- execute thread -------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return not self._dead.is_set()

    def start(self) -> "EngineLoop":
        for t in self._threads:
            t.start()
        return self

    def submit(self, handle: Any, req: ParsedRequest, key: str = "") -> None:
        if self._dead.is_set():
            self.reject(handle, "the engine has stopped; the model is unavailable", "unavailable")
            return
        refused = self._admission.refusal()
        if refused:
            self.reject(handle, refused, "unavailable")
            return
        grammars = getattr(self.engine, "grammars", None)
        if req.params.structured_outputs is not None and grammars is not None:
            # compiled here, on the caller's thread, so that the loop finds it in the cache
            # instead of stalling every running request while a large schema compiles
            try:
                grammars.compile(req.params.structured_outputs)
            except ValueError as e:
                self.reject(handle, str(e))
                return
        rid = str(next(self._ids))
        with self._lock:
            self._handles[rid] = (handle, key)
            if key:
                self._keys[key] = rid
        self._inbox.put((rid, handle, req, time.monotonic(), key))
        if self._dead.is_set():          # died between the check and the put: loop won't see it
            self._drain_inbox_with_error()

    def stop(self, key: str, handle: Any = None) -> None:
        """Cancel the request submitted with `key` (a no-op if it has finished); `handle`, the
        stop request's own sender, gets an empty final response."""
        with self._lock:
            rid = self._keys.get(key)
        if rid is not None:
            self._cancels.put(rid)
        if handle is not None:
            self._outbox.put(Outgoing(handle, final=True))

    def reject(self, handle: Any, message: str, kind: str = "invalid") -> None:
        self._outbox.put(Outgoing(handle, error=message, error_kind=kind, final=True))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._threads[0].join(timeout)
        self._outbox.put(None)
        for t in self._threads[1:]:
            t.join(timeout)

    # ---- loop thread ----------------------------------------------------------------------
    def _run(self) -> None:
        last_stats = 0.0
        period: Optional[BusyPeriod] = None
        try:
            while not self._stop.is_set():
                busy = self.engine.has_unfinished()
                self._take_inbox(block=not busy)
                self._take_cancels()
                self._admit_and_expire()
                self._probe_queued(time.monotonic())
                if self.engine.has_unfinished():
                    t0 = time.monotonic()
                    period = period or BusyPeriod(t0)
                    outputs = self.engine.step()
                    now = time.monotonic()
                    tokens = getattr(self.engine, "last_step_tokens", 0)
                    if self.metrics is not None and tokens:
                        self.metrics.on_step(tokens)
                    for out in outputs:
                        self._on_output(out, now)
                    self._admit_and_expire()
                    period.add_step(t0, now, time.monotonic(), len(outputs))
                    busy = True
                now = time.monotonic()
                idle_now = not self.engine.has_unfinished()
                if busy and idle_now and period is not None:
                    if self._info is not None:
                        self._sender.notes.put(period.line(now, self.engine))
                    period = None
                if now - last_stats >= self._stats_period_s or (busy and idle_now):
                    last_stats = now
                    if self.metrics is not None:
                        self.metrics.on_stats(self.engine.stats())
        except BaseException as e:  # noqa: BLE001 - any failure leaves the engine unusable
            self._log(f"engine loop died: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            self._die()
            return
        for rid, live in list(self._live.items()):     # shutdown: close what is still open
            self._finish(rid, Outgoing(live.handle, error="the server is shutting down",
                                       error_kind="unavailable", final=True))
        self._drain_inbox_with_error("the server is shutting down")

    def _take_inbox(self, block: bool) -> None:
        for item in take_batch(self._inbox, 0.1 if block else 0)[0]:
            self._add(*item)

    def _add(self, rid: str, handle: Any, req: ParsedRequest, arrival: float, key: str) -> None:
        try:
            if req.beam_width > 1:
                self._beams.add(rid, req)
            else:
                self.engine.add_request(rid, req.engine_prompt(), req.params,
                                        priority=req.priority, cache_salt=req.cache_salt,
                                        detokenize=False, arrival_time=arrival)
        except ValueError as e:                        # names the field and the allowed range
            self._forget(rid)
            self._outbox.put(Outgoing(handle, error=str(e), error_kind="invalid", final=True))
            return
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the loop
            self._log(f"add_request failed: {type(e).__name__}: {e}")
            self._forget(rid)
            self._outbox.put(Outgoing(handle, error="internal error while adding the request",
                                      error_kind="internal", final=True))
            return
        self._live[rid] = LiveRequest(handle, req, key, text_mode=bool(req.params.stop),
                                      arrival=arrival)

    def _take_cancels(self) -> None:
        ids, early = [], []
        for rid in take_batch(self._cancels, 0)[0]:
            live = self._live.get(rid)
            if live is None:
                # stop() and the poll can see a request before this loop has taken it from
                # the inbox: keep its cancel for the next round (dropped once it has finished)
                with self._lock:
                    if rid in self._handles:
                        early.append(rid)
            elif rid in self._beams:        # its round's sub-requests go, it ends now
                self._beams.drop(rid)
                self._finish(rid, Outgoing(live.handle, error="the request was cancelled",
                                           error_kind="cancelled", final=True), reason="abort")
            elif not live.cancelled:
                live.cancelled = True
                ids.append(rid)
        for rid in early:
            self._cancels.put(rid)
        if ids:
            self.engine.abort(ids)      # frees KV blocks now; final output on the next step

    def _admit_and_expire(self) -> None:
        """Publish the engine's queue length to admission control; end requests that waited
        past max_queue_delay_ms for their first token (admission.py)."""
        if self._admission.config.max_queue_len:
            self._admission.on_engine_waiting(self.engine.stats())
        # a beam search's rounds are its own sub-requests: it has no first token until the end
        live = ((rid, r) for rid, r in self._live.items() if rid not in self._beams)
        for rid, message in self._admission.overdue(live, time.monotonic()):
            self.engine.abort([rid])        # frees its blocks; its last output is ignored
            self._finish(rid, Outgoing(self._live[rid].handle, error=message,
                                       error_kind="unavailable", final=True), reason="abort")

    def _probe_queued(self, now: float) -> None:
        """An empty response to each streamed request without a token for `queued_probe_s`
        (module docstring); looked at every quarter period."""
        if not self._probe_s or now < self._next_probe:
            return
        self._next_probe = now + self._probe_s / 4
        for rid, live in self._live.items():
            if live.num_out or live.cancelled or not live.req.stream or rid in self._beams:
                continue
            if now - max(live.arrival, live.last_probe) >= self._probe_s:
                live.last_probe = now
                self._outbox.put(Outgoing(live.handle, Chunk([], [], None, None, 0, 0,
                                                             request_key=live.key)))

    def _on_output(self, out: Any, now: float) -> None:
        if self._beams.owns(out.request_id):
            self._on_beam_round(out, now)
            return
        live = self._live.get(out.request_id)
        if live is None:
            return
        comp = out.outputs[0]
        new_ids = list(comp.delta_token_ids)
        if not live.started:
            live.started = True
            live.prompt_len = len(out.prompt_token_ids)
            live.tail = list(out.prompt_token_ids[-_TAIL:])
        context = context_for(self.engine.tokenizer, live.tail, len(live.tail))
        if new_ids:
            live.tail = (live.tail + new_ids)[-_TAIL:]
            live.on_tokens(self.metrics, out, len(new_ids), now)
        finished = out.finished or comp.finish_reason is not None
        if finished and live.cancelled:
            self._finish(out.request_id, Outgoing(live.handle, error="the request was cancelled",
                                                  error_kind="cancelled", final=True),
                         reason="abort", now=now)
            return
        text = comp.delta_text if live.text_mode else None
        if live.req.stream:
            if not new_ids and not text and not finished:
                return
            first = live.num_out == len(new_ids)
            chunk = Chunk(new_ids, context, text, comp.finish_reason if finished else None,
                          live.prompt_len, len(new_ids),
                          prefix=live.echo(out.prompt_token_ids, self.engine.tokenizer) if first
                          else "",
                          request_key=live.key,
                          logprobs=last_logprobs(comp.logprobs, len(new_ids), live.req.params),
                          prompt_logprobs=live.prompt_logprobs(out) if first else None)
            if live.held is not None:
                chunk, live.held = merge_chunks(live.held, chunk), None
            if finished:
                self._finish(out.request_id, Outgoing(live.handle, chunk, final=True),
                             reason=comp.finish_reason, now=now)
            elif first or not self._max_rate \
                    or now - live.last_sent >= len(self._live) / self._max_rate:
                live.last_sent = now
                self._outbox.put(Outgoing(live.handle, chunk))
            else:
                live.held = chunk
            return
        live.ids.extend(new_ids)
        if text:
            live.text.append(text)
        if finished:
            prompt = out.prompt_token_ids
            chunk = Chunk(live.ids, context_for(self.engine.tokenizer, prompt, len(prompt)),
                          "".join(live.text) if live.text_mode else None, comp.finish_reason,
                          live.prompt_len, len(live.ids),
                          prefix=live.echo(prompt, self.engine.tokenizer), request_key=live.key,
                          logprobs=last_logprobs(comp.logprobs, len(live.ids), live.req.params),
                          prompt_logprobs=live.prompt_logprobs(out))
            self._finish(out.request_id, Outgoing(live.handle, chunk, final=True),
                         reason=comp.finish_reason, now=now)

    def _on_beam_round(self, out: Any, now: float) -> None:
        """A beam search's sub-request: the best beam goes out once the search ends."""
        ended = self._beams.on_output(out)
        if ended is None:
            return
        rid, beam = ended
        live = self._live[rid]
        if beam is None:
            self._finish(rid, Outgoing(live.handle, error="internal error in beam search",
                                       error_kind="internal", final=True))
            return
        chunk = beam.final_chunk(self.engine.tokenizer, live)
        live.prompt_len = chunk.num_input_tokens
        if chunk.token_ids:
            live.on_tokens(self.metrics, out, len(chunk.token_ids), now)
        self._finish(rid, Outgoing(live.handle, chunk, final=True), reason=chunk.finish_reason,
                     now=now)

    def _finish(self, rid: str, item: Outgoing, reason: Optional[str] = None,
                now: Optional[float] = None) -> None:
        self._beams.drop(rid)
        live = self._live.pop(rid, None)
        self._forget(rid)
        self._outbox.put(item)
        if self.metrics is not None and live is not None and reason is not None:
            live.on_finished(self.metrics, reason, now)

    def _forget(self, rid: str) -> None:
        with self._lock:
            _, key = self._handles.pop(rid, (None, ""))
            self._keys.pop(key, None)

    def _die(self) -> None:
        self._dead.set()
        for rid, live in list(self._live.items()):
            self._finish(rid, Outgoing(live.handle, error="the engine failed; the model is "
                                       "unavailable", error_kind="unavailable", final=True))
        self._drain_inbox_with_error()
        if self._on_dead is not None:
            try:
                self._on_dead()
            except Exception as e:  # noqa: BLE001
                self._log(f"on_dead failed: {e}")

    def _drain_inbox_with_error(self, message: str = "the engine has stopped; the model is "
                                "unavailable") -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                self._forget(item[0])
                self._outbox.put(Outgoing(item[1], error=message, error_kind="unavailable",
                                          final=True))

    def _open_handles(self) -> list[tuple[str, Any]]:
        """(request id, handle) of every request whose final response has not been queued; read
        by the sender's cancel polls."""
        with self._lock:
            return [(rid, handle) for rid, (handle, _) in self._handles.items()]
