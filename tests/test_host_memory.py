"""The host tier's memory (worker/host_memory.py) with a fake cudart: whole pages of its own,
registered once and unregistered once (close() or garbage collection), failures explained; and
CUDA graph capture with the garbage collector paused (worker/cuda_graph.gc_paused)."""
import pytest
import torch


class FakeCudart:
    """torch.cuda.cudart()'s registration calls, recorded (or failing with `rc`)."""

    def __init__(self, rc=0):
        self.rc, self.registered, self.unregistered = rc, {}, []

    def cudaHostRegister(self, ptr, size, flags):
        if not self.rc:
            self.registered[ptr] = size
        return self.rc

    def cudaHostUnregister(self, ptr):
        self.unregistered.append(ptr)
        return 0

    def cudaGetErrorString(self, rc):
        return {712: "part or all of the requested memory range is already mapped"}[rc]


def test_tier_memory_registers_whole_pages_of_its_own_and_unregisters_once(monkeypatch):
    """Small tiers (malloc'd next to each other) each register whole pages no other buffer
    touches; each range is unregistered exactly once: at close() or when garbage-collected."""
    import gc

    from pagedbackend.worker import host_memory
    gc.collect()            # earlier tests' dead engines unpin their real tiers now, not below
    fake, synced = FakeCudart(), []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "synchronize", synced.append)
    cuda, page = torch.device("cuda"), host_memory.PAGE
    tiers = [host_memory.RegisteredHostMemory(n, cuda) for n in (100, 5000, 2 * page, 1)]
    spans = sorted((t.ptr, t.ptr + t.size) for t in tiers)
    for t, n in zip(tiers, (100, 5000, 2 * page, 1)):
        assert t.ptr % page == 0 and t.size % page == 0 and t.size >= n
        assert fake.registered[t.ptr] == t.size and t.bytes.numel() == n
        assert t.bytes.data_ptr() == t.ptr and t.registered
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    tiers[0].close()
    tiers[0].close()
    assert fake.unregistered == [tiers[0].ptr] and not tiers[0].registered
    ptrs = [t.ptr for t in tiers[1:]]
    del tiers, t
    gc.collect()
    assert sorted(fake.unregistered[1:]) == sorted(ptrs) and len(synced) == 4
    assert not host_memory.RegisteredHostMemory(10, torch.device("cpu")).registered


def test_a_failed_registration_says_why(monkeypatch):
    import gc

    from pagedbackend.worker import host_kv, host_memory
    gc.collect()            # (as above: no real tier is freed while cudart is faked)
    consumed = []
    monkeypatch.setattr(host_memory, "_consume_last_error", consumed.append)
    monkeypatch.setattr(host_kv, "RegisteredHostMemory",
                        lambda n, _: host_memory.RegisteredHostMemory(n, torch.device("cuda")))
    cache = torch.zeros(2, 2, 6, 4, 2, 8)
    staging = torch.empty((2, 2, 2, 4, 2, 32), dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(712))
    with pytest.raises(host_memory.HostRegisterError, match=r"pinning the host KV tier: "
                       r"cudaHostRegister of 4096 bytes at 0x[0-9a-f]+ failed: error 712 \(part"
                       r" or all .* already mapped\); these pages belong to this buffer alone"):
        host_kv.HostKVCache(cache, 2, staging, 0.001)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(2))
    monkeypatch.setattr(FakeCudart, "cudaGetErrorString", lambda self, rc: "out of memory")
    with pytest.raises(ValueError, match=r"swap_space=0.001 is invalid: the host could not pin "
                       r"1.91e-06 GiB \(pinning the host KV tier: .* error 2 \(out of memory"):
        host_kv.HostKVCache(cache, 2, staging, 0.001)
    assert len(consumed) == 2


def test_no_garbage_collection_while_a_graph_captures():
    """A dead engine (cyclic garbage) must not be freed mid-capture: its graphs' and host tier's
    release calls would invalidate the capture. Allocations that would trigger collections free
    nothing inside gc_paused; the collector is back on after it."""
    import gc
    import weakref

    from pagedbackend.worker.cuda_graph import gc_paused
    freed = []

    class Engine:
        pass
    dead = Engine()
    dead.me = dead
    weakref.finalize(dead, freed.append, "engine")
    del dead
    with gc_paused():
        junk = [[] for _ in range(20 * gc.get_threshold()[0])]
        assert not freed and not gc.isenabled()
    assert gc.isenabled() and junk
    junk = [[] for _ in range(20 * gc.get_threshold()[0])]
    gc.collect()
    assert freed == ["engine"]
