"""Data-parallel training over the processes torchrun starts (PyTorch DDP), for train.py.

    torchrun --standalone --nproc_per_node 8 train.py -- --n 128 --m 32 --prompts-per-step 8

torchrun starts one process ("rank") per GPU, or per CPU slot, and tells each its RANK, LOCAL_RANK,
WORLD_SIZE and where to meet (MASTER_ADDR/PORT). Every rank holds the whole policy with its LoRA
adapter, takes its share of each step's prompts, and generates, scores and down-samples its own
groups: a group never spans ranks, so PODS itself needs no communication. DDP averages the LoRA
gradients across ranks during the backward pass, so every rank takes the same optimizer step and
the adapters stay identical. Every rank keeps the same number of rollouts, so the average of the
ranks' mean losses is the mean over all of them: the gradient of one process holding every prompt.
With --uniform-groups skip or refill the ranks may update on different numbers of rows; each then
weights its loss by its rows / (all rows / ranks) (policy_update's rows_in_mean), and a rank with
none joins the all-reduce with one row of weight 0 (train.py: informative_step).

The rest is agreement: the ranks stop after the same step (time budget, Ctrl-C), report one row of
metrics (means over all rollouts, seconds of the slowest rank), and rank 0 alone writes files.

Started with plain `python`, the World is one process and every function here hands back its
input, so train.py runs one code path either way.

The `--` in the command matters: torchrun reads `--n` and `--m` anywhere on its command line as
abbreviations of its own options (--nnodes, --nproc-per-node, --master-port, ...) and exits; after
`--` it passes them to train.py untouched.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class World:
    """This process's place among the ranks; `launched` is True under torchrun (even with one rank)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    launched: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0: the one that logs, writes config.json, metrics.jsonl and checkpoints."""
        return self.rank == 0


class LaunchError(ValueError):
    """RANK set without the rest of what torchrun sets (a variable left over in the shell or a job's environment)."""


def world_from_env() -> World:
    """The World torchrun describes in the environment (read before any process group exists,
    so that bad settings are reported before the ranks meet)."""
    if "RANK" not in os.environ:
        return World()
    missing = [name for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]  # torchrun sets all
    if missing:
        problem = f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set"
    else:
        try:
            int(os.environ["MASTER_PORT"])  # (env:// rendezvous reads it as the ranks meet)
            return World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)), True)
        except ValueError:
            problem = "RANK, WORLD_SIZE, LOCAL_RANK or MASTER_PORT is not a number"
    raise LaunchError(f"RANK is set in the environment but {problem}, as torchrun sets them: launch with torchrun, "
                      f"or unset RANK to run one process")


def start(world: World) -> None:
    """Join the other ranks: NCCL between GPUs (one per rank, by LOCAL_RANK), gloo between CPUs.

    The ranks meet through torchrun's store. On one node, under a prefix that names the attempt: with
    `--max-restarts` torchrun restarts all ranks against the same store, where the failed attempt's
    ranks left their addresses, and a restarted rank could read those instead of its new peers'
    (seen with gloo: "connectFullMesh failed ... Connection refused" in 2 of 5 restarts). On several
    nodes each node's agent counts restarts for itself (one whose ranks were healthy counts none), so
    ranks would wait under different prefixes forever: there restarts need a fresh store each time
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which config.check_torchrun asks for)."""
    if not world.launched or dist.is_initialized():
        return
    store, _, _ = next(dist.rendezvous("env://"))  # (world_from_env checked the variables it reads)
    if os.environ.get("GROUP_WORLD_SIZE", "1") == "1":  # one node: one agent, whose restart count every rank shares
        store = dist.PrefixStore(f"pods-attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
    if torch.cuda.is_available():
        torch.cuda.set_device(world.local_rank)  # "cuda" now means this rank's GPU
        dist.init_process_group("nccl", store=store, rank=world.rank, world_size=world.size,
                                device_id=torch.device("cuda", world.local_rank))
    else:
        dist.init_process_group("gloo", store=store, rank=world.rank, world_size=world.size)


def finish(world: World) -> None:
    if world.launched and dist.is_initialized():
        dist.destroy_process_group()


def shard(batch: list, world: World) -> list:
    """This rank's contiguous share of a step's prompts (the caller checks that they divide evenly)."""
    size = len(batch) // world.size
    return batch[world.rank * size : (world.rank + 1) * size]


def wrap(model, world: World):
    """The model under DDP, which averages gradients across ranks in backward; as it is with one process."""
    if not world.launched:
        return model
    return DistributedDataParallel(model, device_ids=[world.local_rank] if torch.cuda.is_available() else None)


def unwrap(model):
    """The model inside a DDP wrapper (for PEFT's own methods: save_pretrained, disable_adapter, ...)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def gradient_sync(model, sync: bool):
    """Context for one micro-batch's forward and backward: DDP communicates only when `sync` (the
    last micro-batch of a step), once for the whole accumulated gradient, instead of every time."""
    if sync or not isinstance(model, DistributedDataParallel):
        return contextlib.nullcontext()
    return model.no_sync()


def _tensor(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device="cuda" if torch.cuda.is_available() else "cpu")


def any_rank(flag: bool, world: World) -> bool:
    """True on every rank when it is True on any (a Ctrl-C, an aborted generation)."""
    if not world.launched:
        return flag
    value = _tensor([float(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def reduce_row(row: dict, world: World, maxima: tuple[str, ...]) -> dict:
    """One metrics row for all ranks: the mean over ranks of each number, which is the mean over all
    rollouts since every rank has as many, except the `maxima` keys (the seconds of the slowest rank, a
    largest value), the max over ranks. (Where ranks update on different numbers of rows, policy_update
    weights its statistics so that this mean is still that over all rows; counts such as train.py's
    informative_rows are made global before, and so come out as they went in.)"""
    if not world.launched:
        return row
    mine = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    # Every rank's keys, in one order. A rank can lack some (policy_update's sampler_gap_* when its kept completions
    # are all empty), and an all_reduce of tensors of unequal lengths aborts gloo and can hang NCCL. A key some ranks
    # lack is the mean over the ranks that have it.
    keys = list(dict.fromkeys(k for theirs in gather(list(mine), world) for k in theirs))
    sums = _tensor([mine.get(k, 0.0) for k in keys])
    counts = _tensor([float(k in mine) for k in keys])
    maxes = _tensor([mine.get(k, -math.inf) for k in keys])
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
    return row | {k: type(mine.get(k, 0.0))((maxes[i] if k in maxima else sums[i] / counts[i]).item())
                  for i, k in enumerate(keys)}


def gather(obj, world: World) -> list:
    """[each rank's obj], on every rank (rank order)."""
    if not world.launched:
        return [obj]
    gathered = [None] * world.size
    dist.all_gather_object(gathered, obj)
    return gathered


def from_main(obj, world: World):
    """Rank 0's obj, on every rank (a decision taken once, e.g. which checkpoint to resume from,
    that ranks on other nodes might otherwise take differently)."""
    if not world.launched:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def barrier(world: World) -> None:
    if world.launched:
        dist.barrier()
