"""The process side of tensor parallelism: process groups for one engine's ranks, and the loop a
worker rank (1..N-1) runs in its own process. Rank 0's side is `tp_runner.TPRunner`.

Process groups are standalone objects built on a per-engine TCPStore (never the global default
group), so two engines in one process or on one host cannot collide.
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
from typing import Any

import torch
import torch.distributed as dist

from pagedbackend.worker.orphan import exit_when_orphaned

HOST = "127.0.0.1"                 # tensor parallelism here is within one host
INIT_TIMEOUT_S = 1800.0            # rendezvous and start-up (loading a large shard takes a while)
# A collective waits only for the other ranks' share of the same step, so this bounds how long a
# rank that is alive but stuck can hold the others; a rank that exits is detected at once.
STEP_TIMEOUT_S = float(os.environ.get("PAGEDBACKEND_TP_TIMEOUT_S", "300"))
ORPHAN_POLL_S = 0.5


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def make_groups(store: Any, rank: int, world: int, backend: str) -> tuple[Any, Any]:
    """(model group, control group). The model's all-reduces run on `backend`; the control group
    is gloo on the host (agreeing on the KV pool size); on the CPU both are one gloo group."""
    ctrl = _gloo(dist.PrefixStore("ctrl", store), rank, world)
    if backend == "gloo":
        return ctrl, ctrl
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = _timeout(STEP_TIMEOUT_S)
    return dist.ProcessGroupNCCL(dist.PrefixStore("model", store), rank, world, opts), ctrl


def _gloo(store: Any, rank: int, world: int) -> Any:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=HOST)]
    opts._timeout = _timeout(INIT_TIMEOUT_S)
    return dist.ProcessGroupGloo(store, rank, world, opts)


def started(model_group: Any, ctrl_group: Any) -> None:
    """Start-up is over: from now on a collective should not wait long for anyone."""
    for group in {id(model_group): model_group, id(ctrl_group): ctrl_group}.values():
        if isinstance(group, dist.ProcessGroupGloo):
            group.set_timeout(_timeout(STEP_TIMEOUT_S))


def agree_min(ctrl_group: Any, value: int) -> int:
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctrl_group)
    return int(t.item())


def worker_main(rank: int, world: int, port: int, backend: str, config: Any, hf_config: dict,
                device: str, dtype: str, max_num_batched_tokens: int, max_model_len: int,
                parent_pid: int, conn: Any) -> None:
    """Entry point of a spawned worker rank. Protocol on `conn` (a pipe to rank 0):
    worker -> rank 0: ("ready", num_kv_blocks) once, or ("error", text) before exiting 1;
    rank 0 -> worker: pickled HostInputs for each step, pickled None to shut down."""
    # if the engine's process dies (even by SIGKILL), leave at once
    exit_when_orphaned(parent_pid, ORPHAN_POLL_S, "tp-orphan-watch")
    from pagedbackend.worker.model_runner import ModelRunner

    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        store = dist.TCPStore(HOST, port, world, is_master=False,
                              timeout=_timeout(INIT_TIMEOUT_S))
        model_group, ctrl_group = make_groups(store, rank, world, backend)
        runner = ModelRunner(config, hf_config, device, dtype, rank, world, model_group)
        blocks = runner.init_kv_cache(max_num_batched_tokens, max_model_len,
                                      agree=lambda n: agree_min(ctrl_group, n))
        started(model_group, ctrl_group)
        conn.send(("ready", blocks))
        with torch.inference_mode():
            while True:
                inputs = pickle.loads(conn.recv_bytes())
                if inputs is None:
                    break
                runner.forward_logits(inputs)
    except EOFError:            # rank 0 closed the pipe without saying goodbye: it is gone
        os._exit(3)
    except BaseException as e:  # noqa: BLE001 - report anything to rank 0, then leave
        try:
            conn.send(("error", f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        sys.stderr.write(f"tensor-parallel worker rank {rank} failed: {type(e).__name__}: {e}\n")
        sys.stderr.flush()
        os._exit(1)
    runner.shutdown()
    # Skip interpreter teardown: process-group destructors may wait on peers that already left.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
