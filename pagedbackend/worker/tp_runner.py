"""Tensor parallelism, rank 0's side: the engine's runner when tensor_parallel_size > 1.

Rank 0 lives in the engine's process and keeps the scheduler and the sampler; it spawns one
worker process per other rank (`tp_worker.worker_main`). Each step it broadcasts the step's
HostInputs to the workers over their pipes, then every rank runs its shard of the forward in
lockstep (the all-reduces and the LM head's all-gather); only rank 0 samples. Workers keep no
per-request state, so `release` never leaves this process.

Failure handling: a watchdog thread waits on the workers' process sentinels. When one exits,
the runner records "tensor-parallel worker rank N exited with code X", aborts the model group
(an NCCL collective would otherwise wait for the dead peer), and every later execute/release
raises that error. Workers leave on their own when this process dies (tp_worker polls its parent).
"""
from __future__ import annotations

import datetime
import logging
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
import weakref
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from pagedbackend.config import EngineConfig
from pagedbackend.core.scheduler import SchedulerOutput
from pagedbackend.models.llama import LlamaArgs
from pagedbackend.worker import tp_worker
from pagedbackend.worker.model_runner import ModelRunner, RunnerResult

logger = logging.getLogger("pagedbackend")

EXIT_GRACE_S = 5.0       # how long a failed collective waits for the culprit's exit to show
JOIN_TIMEOUT_S = 5.0     # how long shutdown waits for a worker before terminating it


class TPRunner:
    """Same interface as ModelRunner for the engine: num_kv_blocks, execute, release, shutdown."""

    def __init__(self, config: EngineConfig, files: Any):
        info = files.info
        world = config.tensor_parallel_size
        LlamaArgs.from_hf(files.hf_config).check_tp(world)     # refuse before spawning anything
        backend = config.distributed_backend or ("nccl" if info.device == "cuda" else "gloo")
        if backend == "nccl" and info.device != "cuda":
            raise ValueError("distributed_backend='nccl' is invalid: must be 'gloo' when "
                             "device='cpu'")
        if info.device == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(f"tensor_parallel_size={world} is invalid: must be at most the "
                             f"number of visible GPUs ({torch.cuda.device_count()})")
        # Port 0: the OS picks a free port for this engine's store, so engines never collide.
        store = dist.TCPStore(tp_worker.HOST, 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=tp_worker.INIT_TIMEOUT_S))
        self._workers = _Workers(store)
        self._finalizer = weakref.finalize(self, self._workers.close)
        try:
            self._workers.spawn(world, store.port, backend, config, files.hf_config, info)
            self.runner: ModelRunner = self._workers.watched(
                lambda: self._start_rank0(store, world, backend, config, files.hf_config, info))
            blocks = self._workers.wait_ready()
        except BaseException:
            self._finalizer()
            raise
        self.num_kv_blocks = min([self.runner.num_kv_blocks] + blocks)
        self.num_host_blocks = self.runner.num_host_blocks   # the same shard size on every rank
        self._workers.start_watchdog()
        logger.info("tensor parallel: %d ranks (%s), %d KV blocks per rank", world, backend,
                    self.num_kv_blocks)

    def _start_rank0(self, store, world, backend, config, hf_config, info) -> ModelRunner:
        model_group, ctrl_group = tp_worker.make_groups(store, 0, world, backend)
        self._workers.groups = (model_group, ctrl_group)
        runner = ModelRunner(config, hf_config, info.device, info.dtype, 0, world, model_group)
        runner.init_kv_cache(info.max_num_batched_tokens, info.max_model_len,
                             agree=lambda n: tp_worker.agree_min(ctrl_group, n))
        tp_worker.started(model_group, ctrl_group)
        return runner

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerResult:
        self._workers.raise_if_failed()
        h = self.runner.prepare(sched)
        try:
            self._workers.broadcast(h)
            logits = self.runner.forward_logits(h)
        except Exception as e:  # noqa: BLE001 - a collective failed: find out who left
            raise self._workers.failure_after(e) from e
        try:
            result = self.runner.sample(sched, h, logits)
        except Exception as e:  # noqa: BLE001
            if self._workers.backend != "nccl":
                raise               # a sampling error of rank 0's own; the ranks are in step
            # On the GPU a dead peer shows up here at the latest (the first host sync).
            raise self._workers.failure_after(e) from e
        self._workers.raise_if_failed()     # an aborted NCCL group may return garbage quietly
        return result

    # The engine's launch/finish pair: tensor-parallel steps run synchronously.
    def launch(self, sched: SchedulerOutput) -> RunnerResult:
        return self.execute(sched)

    def finish(self, result: RunnerResult) -> RunnerResult:
        return result

    def release(self, request_ids: list[str]) -> None:
        self._workers.raise_if_failed()
        self.runner.release(request_ids)

    def shutdown(self) -> None:
        self._finalizer()
        if hasattr(self, "runner"):
            self.runner.shutdown()

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers.procs]


class _Workers:
    """The worker processes and their pipes. Kept apart from TPRunner so the finalizer and the
    watchdog thread hold no reference to the runner (it can then be garbage-collected)."""

    def __init__(self, store: Any):
        self.store = store                # the master store lives as long as the workers
        self.procs: list[Any] = []        # procs[i] is rank i + 1
        self.conns: list[Any] = []
        self.groups: tuple = ()
        self.backend = "gloo"
        self.failure: Optional[RuntimeError] = None
        self.errors: dict[int, str] = {}  # rank -> the error it reported before exiting
        self.closing = threading.Event()
        self._lock = threading.Lock()

    def spawn(self, world, port, backend, config, hf_config, info) -> None:
        self.backend = backend
        ctx = multiprocessing.get_context("spawn")
        exe = _python_executable()
        if exe:
            ctx.set_executable(exe)
        for rank in range(1, world):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(
                target=tp_worker.worker_main, name=f"pagedbackend-tp-rank{rank}", daemon=True,
                args=(rank, world, port, backend, config, hf_config, info.device, info.dtype,
                      info.max_num_batched_tokens, info.max_model_len, os.getpid(), child_end))
            p.start()
            child_end.close()
            self.procs.append(p)
            self.conns.append(parent_end)

    # -- start-up ------------------------------------------------------------------------
    def watched(self, fn: Callable[[], Any]) -> Any:
        """Run fn (rank 0's start-up, which blocks in rendezvous and collectives) in a thread,
        and raise at once if a worker exits meanwhile instead of waiting for a timeout."""
        box: dict[str, Any] = {}

        def target():
            try:
                box["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                box["error"] = e

        t = threading.Thread(target=target, name="tp-rank0-start", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.1)
            self._check_alive("while starting")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def wait_ready(self) -> list[int]:
        blocks = []
        for rank, conn in enumerate(self.conns, start=1):
            while not conn.poll(0.1):
                self._check_alive("while starting")
            try:
                kind, value = conn.recv()
            except EOFError:
                self._check_alive("while starting", grace=EXIT_GRACE_S)
                raise RuntimeError(f"tensor-parallel worker rank {rank} closed its pipe")
            if kind != "ready":
                self.errors[rank] = value
                self._check_alive("while starting", grace=EXIT_GRACE_S)
                raise RuntimeError(f"tensor-parallel worker rank {rank} failed: {value}")
            blocks.append(value)
        return blocks

    def _check_alive(self, when: str = "", grace: float = 0.0) -> None:
        """Raise the exit error of a worker that has exited; wait up to `grace` for one."""
        deadline = time.monotonic() + grace
        while True:
            if any(p.exitcode is not None for p in self.procs):
                time.sleep(0.2)        # let the others that fall with it be reaped too
                raise self._culprit(when)
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)

    def _culprit(self, when: str) -> RuntimeError:
        # When one rank dies the others fail in their next collective and exit too; name the one
        # that did not merely lose a peer (killed by a signal, or an error of its own).
        exited = [(rank, p.exitcode) for rank, p in enumerate(self.procs, start=1)
                  if p.exitcode is not None]
        texts = {rank: self._error_text(rank) for rank, _ in exited}
        lost_peer = lambda rank: "closed by peer" in texts[rank]   # noqa: E731
        rank, code = min(exited, key=lambda rc: (rc[1] == 1, lost_peer(rc[0]), rc[0]))
        msg = f"tensor-parallel worker rank {rank} exited with code {code}"
        if code < 0:
            try:
                msg += f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        if when:
            msg += f" {when}"
        if texts[rank]:
            msg += f": {texts[rank]}"
        return RuntimeError(msg)

    def _error_text(self, rank: int) -> str:
        """The error a worker reported before exiting, if any (read once, then remembered)."""
        if rank not in self.errors:
            self.errors[rank] = ""
            conn = self.conns[rank - 1]
            try:
                while conn.poll(0):
                    kind, text = conn.recv()
                    if kind == "error":
                        self.errors[rank] = text
            except (EOFError, OSError, ValueError):
                pass
        return self.errors[rank]

    # -- steps ---------------------------------------------------------------------------
    def broadcast(self, msg: Any) -> None:
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(payload)

    def raise_if_failed(self) -> None:
        if self.failure is not None:
            raise self.failure

    def failure_after(self, error: BaseException) -> RuntimeError:
        """The error to raise (now and on every later call) after a step failed with `error`."""
        try:
            self._check_alive(grace=EXIT_GRACE_S)
            failure = RuntimeError(f"tensor-parallel step failed ({type(error).__name__}: "
                                   f"{error}); the engine must be restarted")
        except RuntimeError as e:
            failure = e
        self._fail(failure)
        return self.failure

    def _fail(self, failure: RuntimeError) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = failure
        logger.error("%s", failure)
        if self.backend == "nccl" and self.groups:
            # Make a collective that waits for the dead peer return instead of hanging.
            try:
                self.groups[0].abort()
            except Exception:  # noqa: BLE001 - best effort; the error is recorded already
                pass

    def start_watchdog(self) -> None:
        threading.Thread(target=self._watch, name="tp-watchdog", daemon=True).start()

    def _watch(self) -> None:
        sentinels = [p.sentinel for p in self.procs]
        while not self.closing.is_set():
            if not wait_any(sentinels, timeout=0.5) or self.closing.is_set():
                continue
            try:
                self._check_alive()
            except RuntimeError as e:
                self._fail(e)
                return

    # -- shutdown ------------------------------------------------------------------------
    def close(self) -> None:
        """Stop every worker (politely, then by signal); idempotent, never raises."""
        self.closing.set()
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        for conn in self.conns:
            conn.close()
        self.groups = ()
        self.store = None


def _python_executable() -> Optional[str]:
    """The interpreter for spawned workers. Embedded interpreters (Triton's python-backend stub)
    report their host binary as sys.executable; fall back to the python of the same prefix."""
    exe = sys.executable
    if exe and os.path.basename(exe).startswith("python"):
        return None
    for name in ("python3", "python"):
        candidate = os.path.join(sys.exec_prefix, "bin", name)
        if os.path.exists(candidate):
            return candidate
    return None
