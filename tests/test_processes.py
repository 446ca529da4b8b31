"""serving/processes.py: the /proc process table the supervisor, the fault tests and the soak
walk (parents, groups, command lines, memory)."""
import os
import subprocess
import time

from pagedbackend.serving.processes import descendants, process_table, read_proc


def test_descendants_parents_groups_and_memory():
    # bash and its two sleeps: a tree of depth 2 in a process group of its own
    tree = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 31 & wait"], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while len(descendants(tree.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = descendants(tree.pid)
        assert {p.ppid for p in below} == {tree.pid}
        assert all(p.pgid == tree.pid for p in below)
        assert sorted(p.cmdline for p in below) == ["sleep 30", "sleep 31"]
        assert all(p.live and p.rss_bytes > 0 for p in below)
        # the caller's own process is found, as a child of its parent
        me = read_proc(os.getpid())
        assert me is not None and me.ppid == os.getppid() and me.pid in process_table()
        assert tree.pid in {p.pid for p in descendants(os.getpid())}
    finally:
        tree.kill()
        tree.wait()
    assert read_proc(tree.pid) is None
