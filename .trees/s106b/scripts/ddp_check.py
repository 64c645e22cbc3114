"""DistributedDataParallel over a VisualTokenizer gives the gradients of one
process on the concatenated batch, eager and under torch.compile.

    torchrun --standalone --nproc-per-node 2 scripts/ddp_check.py            # CPU: gloo
    torchrun --standalone --nproc-per-node 1 scripts/ddp_check.py            # one GPU: NCCL
    torchrun --standalone --nproc-per-node 8 scripts/ddp_check.py --compile  # any number of processes

One process per GPU where CUDA is available (NCCL), else CPU processes
(gloo); --backend overrides. Every process builds the same model and the
same global batch from one seed and trains on its own slice of it: one
forward and backward through DDP (and, with --compile, through
torch.compile of the DDP-wrapped model). Every rank then runs the plain model
on the whole batch and compares its every gradient; the script exits non-zero
if any rank's differs by more than float32 rounding (a NaN or Inf counts as a
difference).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from lumenbridge import TokenizerConfig, VisualTokenizer

# The tokenizer's shape at a width that keeps a CPU run to seconds.
CONFIG = dataclasses.replace(TokenizerConfig(), embed_dim=64, stage_widths=(16, 32, 48, 64))
# Relative to each gradient's largest element: float32 rounding of sums in another order.
TOLERANCE = 1e-5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with CUDA, else gloo")
    parser.add_argument("--batch-per-process", type=int, default=2)
    parser.add_argument("--size", type=int, default=64, help="image side, a multiple of 16")
    parser.add_argument("--compile", action="store_true", help="also check torch.compile of the DDP-wrapped model")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend (default inductor)")
    args = parser.parse_args(argv)
    if args.size < 16 or args.size % 16:
        parser.error(f"--size must be a positive multiple of 16, got {args.size}")
    if args.batch_per_process < 1:
        parser.error(f"--batch-per-process must be positive, got {args.batch_per_process}")
    return args


def global_batch(world_size: int, args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 images and a random cotangent of the tokens, the same on every process."""
    generator = torch.Generator().manual_seed(0)
    count = world_size * args.batch_per_process
    images = torch.randint(0, 256, (count, 3, args.size, args.size), dtype=torch.uint8, generator=generator)
    grid = args.size // CONFIG.total_stride
    target = torch.randn(count, grid * grid, CONFIG.embed_dim, generator=generator)
    return images, target


def loss_fn(model, images: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A mean over the batch, so the DDP average over processes is the mean over the global batch."""
    return (model(images) * target).sum() / len(images)


def gradients(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()}


def worst_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest difference relative to the expected gradient's largest
    element (absolute where that is zero), and its tensor; inf where a
    difference is not finite."""
    differences = []
    for name, e in expected.items():
        difference = (got[name] - e).abs().max().item() / (e.abs().max().item() or 1.0)
        differences.append((difference if math.isfinite(difference) else math.inf, name))
    return max(differences)


def check(args: argparse.Namespace, backend: str, device: torch.device) -> int:
    """This rank's part: its DDP gradients against one process's on the whole batch; 1 if any differs."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    images, target = global_batch(world_size, args)
    mine = slice(rank * args.batch_per_process, (rank + 1) * args.batch_per_process)
    model = VisualTokenizer(CONFIG, seed=0, backend="native").to(device)
    checks = {"eager": DistributedDataParallel(copy.deepcopy(model))}
    if args.compile:
        checks["compiled"] = torch.compile(DistributedDataParallel(copy.deepcopy(model)), backend=args.compile_backend)
    results = {}
    for name, wrapped in checks.items():
        loss_fn(wrapped, images[mine].to(device), target[mine].to(device)).backward()
        results[name] = gradients(wrapped.module if name == "eager" else wrapped._orig_mod.module)
    loss_fn(model, images.to(device), target.to(device)).backward()
    expected = gradients(model)
    failed = 0
    for name, got in results.items():
        worst, tensor = worst_difference(got, expected)
        ok = worst <= TOLERANCE
        failed += not ok
        if rank == 0 or not ok:
            print(
                f"DDP {name}, {world_size} x {backend} on {device.type}, rank {rank}: largest gradient difference "
                f"{worst:.1e} of the gradient's scale ({tensor}) against one process on the whole batch: "
                + ("OK" if ok else f"FAILED (more than {TOLERANCE:.0e})"),
                flush=True,
            )
    return int(failed != 0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = args.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.allow_tf32 = False  # float32 on every side, so differences are rounding only
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        verdict = torch.tensor([check(args, backend, device)], device=device)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        return int(verdict.item())
    finally:
        # The DDP models must be gone before their process group: destroying it
        # under a live one made about one run in five abort at exit (SIGABRT).
        torch.compiler.reset()
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
