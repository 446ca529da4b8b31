"""The process table as Linux's /proc shows it: each process's parent, group, state, command
line and resident memory. The supervisor finds the engine's backend stub in it; the fault
tests, the TP tests and the soak walk a server's process tree with it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    state: str          # "R", "S", ..., "Z" for a zombie
    cmdline: str        # arguments joined by spaces
    rss_bytes: int

    @property
    def live(self) -> bool:
        return self.state != "Z"


def read_proc(pid: int) -> Optional[Proc]:
    """The process `pid`, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except (OSError, IndexError):
        return None
    return Proc(pid, int(fields[1]), int(fields[2]), fields[0], cmd, int(fields[21]) * _PAGE)


def process_table() -> dict[int, Proc]:
    """Every process readable now (one may vanish between listing and reading: left out)."""
    procs = (read_proc(int(e)) for e in os.listdir("/proc") if e.isdigit())
    return {p.pid: p for p in procs if p is not None}


def descendants(root: int, table: Optional[dict[int, Proc]] = None) -> list[Proc]:
    """Every process below `root` (children first, then theirs), zombies included."""
    table = process_table() if table is None else table
    out, frontier = [], {root}
    while frontier:
        level = [p for p in table.values() if p.ppid in frontier]
        out += level
        frontier = {p.pid for p in level}
    return out
