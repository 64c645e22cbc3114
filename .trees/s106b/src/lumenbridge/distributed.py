"""The torchrun side of a sharded run: rank and world size from the
environment torchrun sets, a gloo process group for the few small messages
the ranks exchange (the plan's name, size and digest, rank 0's list of shards to do)
and the end-of-run barrier, and its key-value store for progress and stats.

Nothing here moves tokens: every rank writes its own shards to the shared
output folder, so the coordination is small and runs on the CPU (gloo) on
every machine, GPU or not. The same code runs as one process without torchrun.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

# Long enough for ranks that finish their shards at different times to wait for the rest.
TIMEOUT = datetime.timedelta(hours=24)
PREFIX = "lumenbridge/"


class Group:
    """rank, world size and the helpers a run needs; a single process is a group of one."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.initialized_here = False
        if self.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo", timeout=TIMEOUT)
                self.initialized_here = True
            self.store = dist.distributed_c10d._get_default_store()

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def from_main(self, compute: Callable[[], Any]) -> Any:
        """compute() on rank 0, its result on every rank (an exception travels as ("error", message))."""
        if not self.distributed:
            return compute()
        import torch.distributed as dist

        box = [None]
        if self.main:
            try:
                box[0] = ("ok", compute())
            except Exception as error:  # noqa: BLE001 - re-raised on every rank below
                box[0] = ("error", error)
        dist.broadcast_object_list(box, src=0)
        status, value = box[0]
        if status == "error":
            raise value
        return value

    def all_gather(self, value: Any) -> list[Any]:
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        gathered = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered

    # Progress and the ranks' stats go through the store; the end of the run is a barrier.

    def add(self, name: str, amount: int) -> int:
        if not self.distributed:
            return amount
        return int(self.store.add(PREFIX + name, amount))

    def publish(self, name: str, value: Any) -> None:
        if self.distributed:
            self.store.set(PREFIX + name, json.dumps(value))

    def fetch(self, name: str) -> Any:
        return json.loads(self.store.get(PREFIX + name))

    def wait_for_all(self, stats: dict, on_tick: Callable[[], None], interval: float = 0.25) -> list[dict]:
        """Called by every rank once its shards are written: returns every rank's stats
        when all are, calling on_tick meanwhile. A barrier, not a count in the store: a
        rank that dies closes its gloo connections and the barrier raises, where a count
        would wait for ever for a rank on another machine (torchrun stops only the
        ranks of the machine where one failed)."""
        if not self.distributed:
            return [stats]
        import torch.distributed as dist

        self.publish(f"stats/{self.rank}", stats)
        barrier = dist.barrier(async_op=True)
        while not barrier.is_completed():
            on_tick()
            time.sleep(interval)
        barrier.wait()  # raises if a rank died
        on_tick()
        return [self.fetch(f"stats/{rank}") for rank in range(self.world)]

    def close(self) -> None:
        if self.initialized_here:
            import torch.distributed as dist

            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001, S110 - exiting anyway
                pass


def rank_device(device: torch.device, group: Group) -> torch.device:
    """Under torchrun, each local rank takes its own GPU unless --device named one."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", group.local_rank % max(1, torch.cuda.device_count()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device
