"""Per-kernel GPU times of lumenbridge-base (torch.profiler) at B=256 bf16
channels-last: of one forward, for uint8 and float input (where the fused op
spends its time), or with --train of one training step (forward and backward
to every parameter, float input, as bench_fused.py times it: where the
backward spends its time).
Usage: python scripts/profile_tokenize.py [--batch B] [--train] [--no-profiler]"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from lumenbridge import VisualTokenizer, native


def images(kind: str, batch: int) -> torch.Tensor:
    shape = (batch, 3, 224, 224)
    x = (
        torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
        if kind == "uint8"
        else torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    )
    return x.contiguous(memory_format=torch.channels_last)


def run(call, warmups: int, calls: int, profiled: bool):
    """call() warmups times, then calls times (under the profiler if profiled)."""
    for _ in range(warmups):
        call()
    torch.cuda.synchronize()
    if not profiled:
        return None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    return prof


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--no-profiler", action="store_true", help="only run the calls (for ncu)")
    parser.add_argument("--train", action="store_true", help="a training step instead of a forward")
    args = parser.parse_args()
    assert native.ready()
    model = VisualTokenizer(seed=0).to("cuda", torch.bfloat16)
    if args.train:
        x = images("float", args.batch)
        cotangent = torch.randn_like(model(x))

        def step():
            model.zero_grad(set_to_none=True)
            model(x).backward(cotangent)

        prof = run(step, 3, 5, not args.no_profiler)
        if prof is not None:
            print(f"== training step, float input, B={args.batch}, 5 steps")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=90))
        return
    model.eval()
    for kind in ("uint8", "float"):
        x = images(kind, args.batch)
        with torch.inference_mode():
            prof = run(lambda x=x: model(x), 3, 10, not args.no_profiler)
        if prof is not None:
            print(f"== {kind} input, B={args.batch}, 10 calls")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))


if __name__ == "__main__":
    main()
