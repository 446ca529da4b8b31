"""The serving threads' one queue idiom: wait for an item, then take what queued up behind it."""
from __future__ import annotations

import queue
from typing import Optional


def take_batch(q: queue.SimpleQueue, timeout: Optional[float] = None) -> tuple[list, bool]:
    """Items from q: the first waited for (up to timeout; none if it passes), then everything
    already queued. None in the queue is the stop sentinel: it ends the batch and is not
    returned; the flag says it was seen."""
    try:
        batch = [q.get(timeout=timeout)]
    except queue.Empty:
        return [], False
    while batch[-1] is not None:
        try:
            batch.append(q.get_nowait())
        except queue.Empty:
            return batch, False
    batch.pop()
    return batch, True
