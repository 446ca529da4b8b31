"""Where the engine loop's time went between idling and idling again: one line per busy period,
for comparing the engine behind Triton with offline runs of the same requests."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class BusyPeriod:
    start: float
    steps: int = 0
    step_s: float = 0.0            # in engine.step()
    outputs_s: float = 0.0         # turning its outputs into responses
    outputs: int = 0
    slowest_s: float = 0.0         # the longest single engine.step(), and when it began
    slowest_at: float = 0.0

    def add_step(self, t0: float, stepped: float, handled: float, outputs: int) -> None:
        """One step that began at t0, returned at `stepped` and whose `outputs` were turned
        into responses by `handled`."""
        self.steps += 1
        self.step_s += stepped - t0
        if stepped - t0 > self.slowest_s:
            self.slowest_s, self.slowest_at = stepped - t0, t0 - self.start
        self.outputs_s += handled - stepped
        self.outputs += outputs

    def line(self, now: float, engine: Any) -> str:
        wall = max(now - self.start, 1e-9)
        line = (f"busy period: {wall:.2f} s, {self.steps} steps, engine.step "
                f"{self.step_s / wall:.0%} of the wall, output handling "
                f"{self.outputs_s / wall:.0%} "
                f"({self.outputs_s / max(self.outputs, 1) * 1e6:.1f} us per request-step), "
                f"slowest step {self.slowest_s * 1e3:.1f} ms at +{self.slowest_at:.2f} s")
        summary = getattr(engine, "timing_summary", None)
        if summary is not None:
            try:
                split = summary(reset=True)
                line += "; engine step split: " + ", ".join(
                    f"{k} {v:.3g}" for k, v in split.items() if isinstance(v, (int, float)))
                if split.get("path_steps"):
                    line += "; steps by path: " + ", ".join(
                        f"{k} {v}" for k, v in split["path_steps"].items())
                if split.get("path_ms"):
                    line += "; ms a step by path: " + ", ".join(
                        f"{k} {v:.3g}" for k, v in split["path_ms"].items())
            except Exception as e:  # noqa: BLE001 - a note must never stop the loop
                line += f"; no step split ({type(e).__name__})"
        return line
