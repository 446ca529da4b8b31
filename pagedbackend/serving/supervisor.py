"""Watch a running tritonserver's engine stub and restart the server when the stub dies.

Why: when the engine's `triton_python_backend_stub` dies (SIGKILL, OOM killer, a segfault in a
kernel), Triton 2.51 neither restarts it nor fails its open requests: the model keeps reporting
ready, new requests get 400 "Stub process 'engine_0_0' is not healthy", and every request that
was in flight hangs until its client gives up (measured: an HTTP stream still open after 40 s).
Unloading and loading the model brings the engine back, but the hung requests stay hung; only
closing the server's connections ends them. So the supervisor stops tritonserver at once
(SIGTERM, SIGKILL after `stop_timeout_s`): each open request ends with a connection error within
seconds, health checks fail, and a fresh server starts on the same ports, at most
`max_restarts` times (then it exits with an error). The engine stub also goes away when the
engine model unloads itself after its loop died (engine_loop.py): that too restarts the server.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from pagedbackend.serving.processes import process_table

ENGINE_STUB = ("triton_python_backend_stub", "/engine/1/model.py")


def engine_stub_pids(root: int) -> list[int]:
    """Live (not zombie) engine stubs started by the tritonserver process `root`."""
    return [p.pid for p in process_table().values()
            if p.ppid == root and p.live and all(part in p.cmdline for part in ENGINE_STUB)]


class Supervisor:
    """`run()` waits on `server` (a launcher.TritonServer already started) until it exits or
    `stopping()` says so, restarting it when its engine stub dies."""

    def __init__(self, server, max_restarts: int = 3, poll_s: float = 0.5,
                 stop_timeout_s: float = 2.0, ready_timeout_s: float = 600.0,
                 log: Callable[[str], None] = print):
        self.server, self.max_restarts, self.poll_s = server, max_restarts, poll_s
        self.stop_timeout_s, self.ready_timeout_s, self.log = (stop_timeout_s,
                                                               ready_timeout_s, log)
        self.restarts = 0
        self._stub: Optional[int] = None

    def stub_died(self) -> Optional[str]:
        """Why the engine stub seen before is gone, or None (also before it first appears)."""
        pids = engine_stub_pids(self.server.proc.pid)
        if pids:
            self._stub = pids[0]
            return None
        if self._stub is None:
            return None
        gone, self._stub = self._stub, None
        return f"the engine's backend stub (pid {gone}) is gone"

    def run(self, stopping: Callable[[], bool] = lambda: False) -> int:
        while not stopping():
            code = self.server.proc.poll()
            if code is not None:
                self.log(f"tritonserver exited with code {code}")
                return code or 1
            reason = self.stub_died()
            if reason is None:
                time.sleep(self.poll_s)
                continue
            if self.restarts >= self.max_restarts:
                self.log(f"{reason}; restarted {self.restarts} times already: stopping")
                self.server.stop(self.stop_timeout_s)
                return 1
            self.restarts += 1
            self.log(f"{reason}: Triton cannot recover it and its open requests would hang; "
                     f"restarting tritonserver ({self.restarts}/{self.max_restarts})")
            self.server.restart(self.stop_timeout_s)
            try:
                self.server.wait_ready(self.ready_timeout_s)
            except (RuntimeError, TimeoutError) as e:
                self.log(f"tritonserver did not come back: {e}")
                self.server.stop(self.stop_timeout_s)
                return 1
            self.log(f"tritonserver ready again: HTTP {self.server.http_url}")
        return 0
