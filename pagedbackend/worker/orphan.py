"""Leave a process at once when its parent dies without stopping it (SIGKILL, a crash): the
process is re-parented, so its parent pid changes. Without torch: the Triton launcher's
processes use it too."""
from __future__ import annotations

import os
import threading
import time
from typing import Optional


def exit_when_orphaned(parent_pid: Optional[int] = None, poll_s: float = 1.0,
                       name: str = "orphan-watch") -> threading.Thread:
    """Start a daemon thread that calls os._exit(3) once this process's parent is no longer
    `parent_pid` (default: the parent now). A spawner passes the pid it knows, so a child
    whose parent died before this thread started still leaves. os._exit leaves even while
    the main thread is blocked (a collective, the device, IPC to a dead server)."""
    parent = os.getppid() if parent_pid is None else parent_pid

    def watch() -> None:
        while True:
            time.sleep(poll_s)
            if os.getppid() != parent:
                os._exit(3)

    thread = threading.Thread(target=watch, daemon=True, name=name)
    thread.start()
    return thread
