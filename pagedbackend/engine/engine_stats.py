"""What the engine reports about itself: StepTiming (where a step's wall time goes, for the
perf scripts) and EngineStats (the snapshot the Triton engine model turns into vLLM's metrics)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass
class StepTiming:
    """Where a step's wall time goes (perf scripts read it; summed over steps)."""
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0          # first step start -> last step end
    first: float = 0.0
    schedule_s: float = 0.0
    execute_s: float = 0.0       # prepare + launch + wait for the sampled ids
    postprocess_s: float = 0.0   # scheduler update + outputs (partly, until collect())

    def add(self, t0: float, t1: float, t2: float, t3: float, tokens: int) -> None:
        if not self.steps:
            self.first = t0
        self.wall_s = t3 - self.first
        self.steps += 1
        self.tokens += tokens
        self.schedule_s += t1 - t0
        self.execute_s += t2 - t1
        self.postprocess_s += t3 - t2

    def summary(self, sync_wait_s: float, gpu_busy_s: float = 0.0,
                path_steps: Optional[dict] = None,
                path_time: Optional[tuple[dict, dict]] = None) -> dict:
        """Per-step means. gpu_busy_ms (CUDA) is the device time from a step's first upload to
        its ids being copied out; gpu_idle_fraction = 1 - busy / wall over the steps timed;
        path_steps: the runner's step counts by path (model_runner.new_path_steps);
        path_time: the runner's (seconds, steps timed) by path, reported as path_ms, the mean
        milliseconds a step of each path took (device time on CUDA, wall time on the CPU)."""
        path_ms = {k: path_time[0][k] / c * 1e3 for k, c in path_time[1].items() if c} \
            if path_time is not None else None
        n = max(1, self.steps)
        host = self.schedule_s + self.execute_s + self.postprocess_s - sync_wait_s
        return {"steps": self.steps, "tokens_per_step": self.tokens / n,
                "step_ms": (self.schedule_s + self.execute_s + self.postprocess_s) / n * 1e3,
                "schedule_ms": self.schedule_s / n * 1e3,
                "execute_ms": self.execute_s / n * 1e3,
                "postprocess_ms": self.postprocess_s / n * 1e3,
                "gpu_wait_ms": sync_wait_s / n * 1e3, "host_ms": host / n * 1e3,
                "gpu_busy_ms": gpu_busy_s / n * 1e3,
                "gpu_idle_fraction": (max(0.0, 1 - gpu_busy_s / self.wall_s)
                                      if gpu_busy_s and self.wall_s else None),
                **({"path_steps": dict(path_steps)} if path_steps is not None else {}),
                **({"path_ms": path_ms} if path_ms is not None else {})}


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_kv_blocks: int
    num_used_blocks: int
    spec_decode: Optional[Any] = None   # a SpecDecodeStats snapshot, when speculating
    # the host tier (swap_space > 0; zeros without it)
    num_swapped: int = 0
    cpu_cache_usage: float = 0.0
    num_host_blocks: int = 0
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    cpu_prefix_cache_queries: int = 0
    cpu_prefix_cache_hits: int = 0
    preemptions_swap: int = 0
    preemptions_recompute: int = 0
