"""Where a `lumenbridge tokenize --decode gpu` process spends the time outside its run.

bench_pipeline.py reports images/s over the run's wall time and over the whole
process; on the GPU machines the two differ by seconds. This measures the parts:

1. each start-up step alone, as its own fresh interpreter (the least of --repeats):
   Python, importing torch, creating the CUDA context, importing lumenbridge, loading the built
   extension, importing torchvision.io, and building the model on the GPU with one forward;
2. one `tokenize --decode gpu` of the images (to /dev/shm), split into the time before the run
   starts, the run's own wall time (its --report) and the time from the report's write to the
   process's exit;
3. the same command under cProfile: the main thread's functions by cumulative time.

    python benchmarks/bench_start.py --out results/ --data DIR   # DIR: bench_pipeline.py's --data
"""

from __future__ import annotations

import argparse
import json
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import TMPFS, child_environment, image_files, write_images

STEPS = {
    "python": "pass",
    "import torch": "import torch",
    "import torch, CUDA context": "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()",
    "import lumenbridge": "import lumenbridge",
    "import lumenbridge, load the extension": (
        "import lumenbridge.extension as e; assert e.load(build_missing=False), e.load_error()"
    ),
    "import torchvision.io": "import torchvision.io",
    "model on the GPU, one forward": (
        "import torch, lumenbridge; "
        "m = lumenbridge.VisualTokenizer(lumenbridge.TokenizerConfig.preset('lumenbridge-base'), seed=0)"
        ".to('cuda', torch.bfloat16).eval(); "
        "x = torch.zeros(256, 3, 224, 224, dtype=torch.uint8, device='cuda'); "
        "torch.inference_mode()(m)(x); torch.cuda.synchronize()"
    ),
}


def python(*arguments: str) -> list[str]:
    return [sys.executable, *arguments]


def step_seconds(code: str, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run_python(["-c", code])
        best = min(best, time.perf_counter() - started)
    return best


def tokenize_command(listed: Path, out: Path, report: Path, batch_size: int) -> list[str]:
    return [
        *("-m", "lumenbridge", "tokenize", str(listed), "--out", str(out), "--decode", "gpu"),
        *("--batch-size", str(batch_size), "--report", str(report)),
    ]


def run_python(arguments: list[str]) -> None:
    """Runs a child interpreter; its stderr is printed if it fails."""
    try:
        subprocess.run(python(*arguments), env=child_environment(), check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        print(error.stderr, file=sys.stderr)
        raise


def timed_tokenize(command: list[str], out: Path, report: Path) -> dict:
    """The process's seconds before its run, in it and after it (the report is written as the run ends)."""
    shutil.rmtree(out, ignore_errors=True)
    started = time.time()
    run_python(command)
    ended = time.time()
    wall = json.loads(report.read_text())["wall_seconds"]
    reported = report.stat().st_mtime
    shutil.rmtree(out, ignore_errors=True)
    return {
        "process": ended - started,
        "before_run": reported - wall - started,
        "run": wall,
        "after_report": ended - reported,
    }


def profiled_tokenize(command: list[str], out: Path, profile: Path, top: int) -> str:
    shutil.rmtree(out, ignore_errors=True)
    run_python(["-m", "cProfile", "-o", str(profile), *command])
    shutil.rmtree(out, ignore_errors=True)
    listing = Path(str(profile) + ".txt")
    with listing.open("w") as stream:
        pstats.Stats(str(profile), stream=stream).sort_stats("cumulative").print_stats(top)
    return listing.read_text()


def machine() -> dict:
    import torch
    import torchvision

    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for bench_start.json and the profile")
    parser.add_argument("--data", help="folder of JPEGs (made if missing; default: a temporary folder, removed)")
    parser.add_argument("--images", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256, help="tokenize's --batch-size (default: 256)")
    parser.add_argument("--top", type=int, default=40, help="functions listed from the profile")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.data).resolve() if args.data else Path(tempfile.mkdtemp(prefix="lumenbridge-start-"))
    tokens = TMPFS / "lumenbridge-start"
    try:
        write_images(scratch / "images", args.images, 16)
        listed = scratch / f"images-{args.images}.txt"
        listed.write_text("".join(f"{path}\n" for path in image_files(scratch / "images")[: args.images]))
        steps = {name: step_seconds(code, args.repeats) for name, code in STEPS.items()}
        report = scratch / "report-start.json"
        command = tokenize_command(listed, tokens, report, args.batch_size)
        process = timed_tokenize(command, tokens, report)
        profile = profiled_tokenize(command, tokens, out / "bench_start.prof", args.top)
    finally:
        shutil.rmtree(tokens, ignore_errors=True)
        if not args.data:
            shutil.rmtree(scratch, ignore_errors=True)
    named = " ".join(command).replace(str(scratch), "DATA").replace(str(tokens), "SHM")
    record = {"machine": machine(), "command": named, "steps": steps, "process": process}
    (out / "bench_start.json").write_text(json.dumps(record, indent=2) + "\n")
    print(profile)
    for name, seconds in steps.items():
        print(f"  {name:<40} {seconds:6.2f} s (alone, from a fresh interpreter)")
    print("  tokenize --decode gpu: " + ", ".join(f"{name} {seconds:.2f} s" for name, seconds in process.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
