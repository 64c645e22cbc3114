"""Per-kernel GPU times of one lumenbridge-base forward (torch.profiler), at
B=256 bf16 channels-last, uint8 and float input: where the fused op spends
its time. Usage: python scripts/profile_tokenize.py [--batch B]"""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from lumenbridge import VisualTokenizer, native

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--no-profiler", action="store_true", help="only run the calls (for ncu)")
args = parser.parse_args()
assert native.ready()
model = VisualTokenizer(seed=0).to("cuda", torch.bfloat16).eval()
for kind in ("uint8", "float"):
    shape = (args.batch, 3, 224, 224)
    x = (
        torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda")
        if kind == "uint8"
        else torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    )
    x = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        for _ in range(3):
            model(x)
        torch.cuda.synchronize()
        if args.no_profiler:
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                model(x)
            torch.cuda.synchronize()
    if args.no_profiler:
        continue
    print(f"== {kind} input, B={args.batch}, 10 calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))
