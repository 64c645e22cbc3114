"""End-to-end throughput of `lumenbridge tokenize` against decode-only throughput, in one run.

Generates photo-like JPEGs (300 to 600 px a side) on local disk, then measures:

1. decode only, GPU: the files' bytes already in memory, torchvision.io.decode_jpeg(device="cuda")
   in batches (as the issue's reference figure), and the same plus LumenBridge's GPU resize and crop;
2. decode only, CPU: Pillow decoding, resizing and cropping in --workers DataLoader processes,
   reading the files (LumenBridge's own SampleDataset, no model);
3. end to end: `lumenbridge tokenize FOLDER --out DIR --decode gpu` (and, unless --quick or
   --skip-cpu-e2e, the same with --decode cpu) as a subprocess: files in, shards on disk, with
   the run's own time breakdown (--report) and the peak host memory of its process tree; then
   --decode gpu again with the shards in /dev/shm (unless --no-tmpfs), which shows what the
   pipeline does where the disk's write speed (measured too) is not the limit. `--runs 1x1 1x2 2x2`
   repeats both --decode gpu runs for each number of processes on the GPU (torchrun) and of
   --open-shards, in the same run.

Prints a table and writes everything to OUT/bench_pipeline.json. Times on the H200 machine,
after the extension build (about 70 s on a fresh machine, included in the run):

    python benchmarks/bench_pipeline.py --out results/            # 20,000 images, about 3 minutes
    python benchmarks/bench_pipeline.py --out results/ --quick    # 4,000 images, about 1 minute
"""

from __future__ import annotations

import argparse
import errno
import io
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TMPFS = Path("/dev/shm")


def photo_jpeg(seed: int) -> bytes:
    """A photo-like JPEG: smooth gradients, soft blobs, texture and sensor noise, quality 85-95."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = (int(v) for v in rng.integers(300, 601, size=2))
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    image = np.zeros((height, width, 3), np.float32)
    for channel in range(3):
        angle, phase = rng.uniform(0, np.pi), rng.uniform(0, 2 * np.pi)
        image[..., channel] = 110 + 70 * np.sin((x * np.cos(angle) + y * np.sin(angle)) / rng.uniform(60, 250) + phase)
    for _ in range(int(rng.integers(3, 9))):
        cx, cy, radius = rng.uniform(0, width), rng.uniform(0, height), rng.uniform(20, 160)
        blob = np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * radius**2))
        image += blob[..., None] * rng.uniform(-90, 90, size=3)
    image += 12 * np.sin(x / rng.uniform(2, 6))[..., None] * np.sin(y / rng.uniform(2, 6))[..., None]
    image += rng.normal(0, 5, image.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(buffer, "JPEG", quality=int(rng.integers(85, 96)))
    return buffer.getvalue()


def write_images(folder: Path, count: int, processes: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    existing = image_files(folder)
    if len(existing) >= count:
        paths = existing[:count]
        return {"images": count, "bytes": sum(os.path.getsize(path) for path in paths), "seconds": 0.0, "reused": True}
    started = time.perf_counter()
    total = 0
    with ProcessPoolExecutor(processes) as pool:
        for index, data in enumerate(pool.map(photo_jpeg, range(count), chunksize=64)):
            (folder / f"{index // 1000:03}").mkdir(exist_ok=True)
            (folder / f"{index // 1000:03}" / f"{index:07}.jpg").write_bytes(data)
            total += len(data)
    return {"images": count, "bytes": total, "seconds": time.perf_counter() - started, "reused": False}


def image_files(folder: Path) -> list[str]:
    return sorted(str(path) for path in folder.rglob("*.jpg"))


def gpu_decode_only(paths: list[str], batch_size: int, image_size: int, resize: int) -> dict:
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    from lumenbridge.gpu_decode import crop_resize, crop_resize_reference, decode_jpegs

    data = [torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8) for path in paths]
    batches = [data[i : i + batch_size] for i in range(0, len(data), batch_size)]
    device = torch.device("cuda")
    stream = torch.cuda.Stream()
    results = {}
    with torch.cuda.stream(stream):
        decode_jpeg(batches[0], mode=ImageReadMode.RGB, device=device)  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        for batch in batches:
            decode_jpeg(batch, mode=ImageReadMode.RGB, device=device)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        results["decode_jpeg_cuda"] = {"images_per_second": len(data) / seconds, "seconds": seconds}
        # The op, then the roi_align route it replaced, on the same batches.
        for name, resample in (
            ("decode_resize_crop_cuda", crop_resize),
            ("decode_resize_crop_cuda_roi_align", crop_resize_reference),
        ):
            started = time.perf_counter()
            for batch in batches:
                resample(decode_jpegs(batch, device), image_size, resize)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - started
            results[name] = {"images_per_second": len(data) / seconds, "seconds": seconds}
    return results


def cpu_decode_only(paths: list[str], workers: int, batch_size: int, image_size: int, resize: int, gpu: bool) -> dict:
    """LumenBridge's DataLoader stage alone: Pillow decode + resize + crop (gpu=False), or
    reading and header checks for --decode gpu (gpu=True), in `workers` processes."""
    import torch

    from lumenbridge.pipeline import SampleDataset, collate
    from lumenbridge.sources import Sample

    plan = [Sample(path, path) for path in paths]
    loader = torch.utils.data.DataLoader(
        SampleDataset(plan, image_size, resize, gpu=gpu),
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=collate,
        prefetch_factor=4,
    )
    started = time.perf_counter()
    images = 0
    for batch in loader:
        images += len(batch.indices)
    seconds = time.perf_counter() - started
    return {"images_per_second": images / seconds, "seconds": seconds, "workers": workers}


class PeakMemory(threading.Thread):
    """Peak resident memory of a process and its children (psutil), sampled every 0.2 s."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        try:
            import psutil
        except ImportError:
            return
        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.done.is_set():
            try:
                processes = [root, *root.children(recursive=True)]
                rss = 0
                for process in processes:
                    try:
                        memory = process.memory_full_info()
                        rss += getattr(memory, "uss", memory.rss)  # unique memory: shared pages are not counted
                    except psutil.Error:
                        continue
                self.peak = max(self.peak, rss)
            except psutil.Error:
                return
            time.sleep(0.2)


def child_environment() -> dict:
    """This environment, with this checkout's src first on PYTHONPATH: a child process runs its lumenbridge."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def end_to_end(images: Path, out: Path, decode: str, args, report: Path, ranks: int, open_shards: int) -> dict:
    """`lumenbridge tokenize` of the images that `images`, a file list, names; with
    ranks > 1, that many torchrun processes share the GPU and the --workers."""
    launcher = ["torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m"] if ranks > 1 else []
    command = [
        sys.executable,
        "-m",
        *launcher,
        "lumenbridge",
        "tokenize",
        str(images),
        "--out",
        str(out),
        "--decode",
        decode,
        "--preset",
        args.preset,
        "--batch-size",
        str(args.batch_size),
        "--workers",
        str(max(1, args.workers // ranks)),
        "--shard-size",
        str(args.shard_size),
        "--open-shards",
        str(open_shards),
        "--report",
        str(report),
    ]
    shutil.rmtree(out, ignore_errors=True)  # what a run cut short left in a reused --data folder
    started = time.perf_counter()
    process = subprocess.Popen(
        command, env=child_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    memory = PeakMemory(process.pid)
    memory.start()
    stdout, stderr = process.communicate()
    memory.done.set()
    seconds = time.perf_counter() - started
    if process.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(command)} failed ({process.returncode}):\n{stderr[-4000:]}")
    numbers = json.loads(report.read_text())
    disk = sum(path.stat().st_size for path in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    return {
        "command": " ".join(command[2:]),
        "ranks": ranks,
        "open_shards": open_shards,
        "process_seconds": seconds,
        "peak_host_memory_bytes": memory.peak or None,
        "token_bytes_on_disk": disk,
        "summary": stdout.strip().splitlines(),
        **numbers,
    }


def disk_write_speed(folder: Path, megabytes: int, writers: int, direct: bool) -> float | None:
    """Write with fsync, in bytes/s, `writers` files at once (threads; the writes
    release the GIL), in writes of a batch's tokens (64 MiB): the ceiling for
    writing shards there with that many writers. `direct` opens the files with
    O_DIRECT, so the writes go from the (page-aligned) buffer to the disk
    without a copy into the page cache; None where the file system refuses it."""
    block = mmap.mmap(-1, 64 << 20)  # page-aligned, as O_DIRECT needs
    block.write(os.urandom(1 << 20) * 64)
    writes = max(1, megabytes // 64 // writers)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)

    def write(index: int) -> None:
        descriptor = os.open(folder / f"write-test-{index}.bin", flags, 0o644)
        try:
            for number in range(writes):
                os.pwrite(descriptor, block, number * len(block))
            os.fsync(descriptor)
        finally:
            os.close(descriptor)

    started = time.perf_counter()
    try:
        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(write, range(writers)))
    except OSError as error:
        if not direct or error.errno != errno.EINVAL:
            raise
        return None
    finally:
        for index in range(writers):
            (folder / f"write-test-{index}.bin").unlink(missing_ok=True)
    return writers * writes * len(block) / (time.perf_counter() - started)


def disk_write_speeds(folder: Path, megabytes: int) -> dict:
    """disk_write_speed for one and four writers, through the page cache and direct."""
    return {
        f"{'direct' if direct else 'buffered'}_{writers}": disk_write_speed(folder, megabytes, writers, direct)
        for direct in (False, True)
        for writers in (1, 4)
    }


def run_spec(text: str) -> tuple[int, int]:
    """--runs' RxW: processes and open shards, both positive."""
    try:
        ranks, open_shards = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not RxW (processes x open shards), e.g. 1x2") from None
    if ranks < 1 or open_shards < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: both numbers must be positive")
    return ranks, open_shards


def build_extension() -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "lumenbridge", "build"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])},
        check=True,
        capture_output=True,
    )
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for bench_pipeline.json")
    parser.add_argument("--data", help="folder for the generated JPEGs (default: a temporary folder, removed)")
    parser.add_argument("--images", type=int, help="images to generate (default: 20000, 4000 with --quick)")
    parser.add_argument("--quick", action="store_true", help="fewer images and no CPU end-to-end run: about 1 min")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="DataLoader workers (default: CPUs)")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--shard-size", type=int, default=10_000)
    parser.add_argument("--preset", default="lumenbridge-base")
    parser.add_argument("--skip-cpu-e2e", action="store_true", help="skip `tokenize --decode cpu` end to end")
    parser.add_argument("--no-tmpfs", action="store_true", help="skip the --decode gpu run that writes to /dev/shm")
    parser.add_argument(
        "--runs",
        nargs="+",
        type=run_spec,
        default=None,
        metavar="RxW",
        help="the --decode gpu end-to-end runs, each as R processes on the one GPU (torchrun; the --workers "
        "split between them) with W --open-shards each (default: one process with tokenize's default)",
    )
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import torch

    from lumenbridge.cli import DEFAULT_OPEN_SHARDS

    if not torch.cuda.is_available():
        print("bench_pipeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    count = args.images or (4000 if args.quick else 20_000)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.data).resolve() if args.data else Path(tempfile.mkdtemp(prefix="lumenbridge-bench-"))
    tmpfs_out = TMPFS / f"lumenbridge-bench-{os.getpid()}"
    results: dict = {
        "device": torch.cuda.get_device_name(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "quick": args.quick,
        "settings": {key: getattr(args, key) for key in ("workers", "batch_size", "shard_size", "preset")},
    }

    def save() -> None:
        """The record so far, after each stage: a run cut short keeps what it measured.
        It names the run's folders by their role, not by where they were."""
        text = json.dumps(results, indent=2).replace(str(scratch), "DATA").replace(str(tmpfs_out), "SHM")
        (out / "bench_pipeline.json").write_text(text + "\n")

    try:
        results["extension_build_seconds"] = build_extension()
        print(f"extension ready ({results['extension_build_seconds']:.0f} s)", flush=True)
        folder = scratch / "images"
        # Every CPU generates the images, whatever --workers the runs use.
        results["images"] = write_images(folder, count, os.cpu_count() or 1)
        print(f"images: {results['images']}", flush=True)
        paths = image_files(folder)[:count]
        # The same images for every row, though a reused --data folder may hold more.
        listed = scratch / f"images-{count}.txt"
        listed.write_text("".join(f"{path}\n" for path in paths))
        # Whether more than one writer, or writes that skip the page cache, could raise the ceiling.
        results["disk_write_bytes_per_second"] = disk_write_speeds(scratch, 1024 if args.quick else 4096)
        print(disk_line(results["disk_write_bytes_per_second"]), flush=True)
        save()
        image_size, resize = 224, 256
        results["decode_only"] = gpu_decode_only(paths, args.batch_size, image_size, resize)
        results["decode_only"]["cpu_workers_pillow"] = cpu_decode_only(
            paths, args.workers, args.batch_size, image_size, resize, gpu=False
        )
        results["decode_only"]["cpu_workers_read_for_gpu"] = cpu_decode_only(
            paths, args.workers, args.batch_size, image_size, resize, gpu=True
        )
        print(json.dumps(results["decode_only"], indent=1), flush=True)
        save()
        results["end_to_end"] = {}
        for ranks, open_shards in args.runs or [(1, DEFAULT_OPEN_SHARDS)]:
            name = f"gpu_{ranks}x{open_shards}"
            results["end_to_end"][name] = run = end_to_end(
                listed, scratch / "tokens-gpu", "gpu", args, scratch / "report-gpu.json", ranks, open_shards
            )
            save()
            # The same, writing to memory (tmpfs): what the pipeline does where the disk is not the limit.
            if args.no_tmpfs or not TMPFS.is_dir():
                results["tmpfs_skipped"] = "--no-tmpfs" if args.no_tmpfs else f"no {TMPFS}"
            elif shutil.disk_usage(TMPFS).free <= 1.5 * run["token_bytes_on_disk"]:
                free = shutil.disk_usage(TMPFS).free
                results["tmpfs_skipped"] = f"{TMPFS} has {free} bytes free, under 1.5x the tokens"
            else:
                results["end_to_end"][name.replace("gpu", "gpu_to_tmpfs", 1)] = end_to_end(
                    listed, tmpfs_out, "gpu", args, scratch / "report-tmpfs.json", ranks, open_shards
                )
            save()
        if not (args.quick or args.skip_cpu_e2e):
            results["end_to_end"]["cpu"] = end_to_end(
                listed, scratch / "tokens-cpu", "cpu", args, scratch / "report-cpu.json", 1, DEFAULT_OPEN_SHARDS
            )
            save()
    finally:
        if not args.data:
            shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(tmpfs_out, ignore_errors=True)
    print_table(results)
    return 0


def disk_line(speeds: dict) -> str:
    shown = ", ".join(f"{name} {'refused' if rate is None else f'{rate / 1e9:.2f}'}" for name, rate in speeds.items())
    return f"disk, GB/s written with fsync (writers: files at once): {shown}"


def print_table(results: dict) -> None:
    decode = results["decode_only"]
    rows = [
        ("decode only: decode_jpeg(device=cuda), bytes in memory", decode["decode_jpeg_cuda"]["images_per_second"], ""),
        ("decode only: + GPU resize and crop (the op)", decode["decode_resize_crop_cuda"]["images_per_second"], ""),
        (
            "decode only: + GPU resize and crop (roi_align)",
            decode["decode_resize_crop_cuda_roi_align"]["images_per_second"],
            "",
        ),
        (
            f"decode only: Pillow in {decode['cpu_workers_pillow']['workers']} workers (files)",
            decode["cpu_workers_pillow"]["images_per_second"],
            "",
        ),
        ("reading only, for --decode gpu (files)", decode["cpu_workers_read_for_gpu"]["images_per_second"], ""),
    ]
    for mode, run in results["end_to_end"].items():
        memory = run["peak_host_memory_bytes"]
        note = f"tokenize {100 * run['tokenize_share_of_wall']:.1f}% of wall" + (
            f", peak host memory {memory / 2**30:.1f} GiB" if memory else ""
        )
        where = "shards in /dev/shm" if "tmpfs" in mode else "shards on disk"
        where += f", {run['ranks']} ranks x {run['open_shards']} open shards"
        note += f"; {run['images'] / run['process_seconds']:,.0f}/s counting the process's start"
        decode_mode = "gpu" if mode.startswith("gpu") else "cpu"
        rows.append(
            (f"end to end: tokenize --decode {decode_mode} (files in, {where})", run["images_per_second"], note)
        )
    print(f"\n{results['images']['images']} JPEGs, {results['device']}, {results['cpus']} CPUs")
    print(disk_line(results["disk_write_bytes_per_second"]))
    for name, rate, note in rows:
        print(f"  {name:<64} {rate:>10,.0f} images/s  {note}")
    for mode, run in results["end_to_end"].items():
        print(f"  {mode}: seconds {json.dumps({k: round(v, 2) for k, v in run['seconds'].items()})}")


if __name__ == "__main__":
    raise SystemExit(main())
