"""Figure 7: MP4 encoding, before and after the AVX-512 cap (replicadp_tasks/outputs/video.py), and on 2 and 4 frame threads
(a GPU replica's REPLICADP_ENCODE_THREADS), at 832x480x33.

For each content (the tiny model's output, and a synthetic moving scene) and each libx264 setting: the median
encode time (settings interleaved, so that load on the machine falls on all alike), the file size, the PSNR of
the decoded video against the lossless YUV 4:2:0 encode of the same frames, and how many different MP4s the
same frames gave across encodes whose heap held other garbage each time (glibc's mmap threshold raised, as after
torch has freed large tensors, and freed blocks of random bytes left behind). Prints a table and writes JSON.

    .venv/bin/python bench/encode.py --repeats 7 --out bench-results/encode.json
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import click
import numpy as np
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from client.bench.isolation import psnr_db  # noqa: E402
from client.cli import size_param  # noqa: E402
from replicadp_tasks.contract import DEFAULTS, REFERENCE_SIZE, Accepts  # noqa: E402
from replicadp_tasks.model import ModelOptions  # noqa: E402
from replicadp_tasks.outputs import decode_mp4, encode_mp4  # noqa: E402
from replicadp_tasks.outputs.video import _X264, x264_params  # noqa: E402

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def scene(height: int, width: int, count: int) -> np.ndarray:
    """Moving gradients over a drifting texture, two moving discs, mild noise: a stand-in for camera footage."""
    rng = np.random.default_rng(1)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    texture = np.kron(rng.random((height // 16 + 2, width // 16 + 2, 3)), np.ones((16, 16, 1)))
    frames = []
    for t in range(count):
        img = 0.5 + 0.25 * np.sin((x + 6 * t) / 57.0)[..., None] * np.array([1, 0.6, 0.3]) \
            + 0.15 * np.cos((y - 3 * t) / 41.0)[..., None]
        img = 0.6 * img + 0.4 * texture[t % 16:t % 16 + height, 2 * t % 16:2 * t % 16 + width]
        for cx, cy, r, colour in ((200 + 9 * t, 240, 60, (1, 0.2, 0.2)), (600 - 7 * t, 150 + 4 * t, 40, (0.1, 0.9, 0.3))):
            img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = colour
        frames.append(((img + rng.normal(0, 0.02, img.shape)).clip(0, 1) * 255).round().astype(np.uint8))
    return np.stack(frames)


def tiny_output(height: int, width: int, count: int) -> np.ndarray:
    from replicadp_tasks.contract import validate_request
    from replicadp_tasks.model import PipelineHolder
    from replicadp_tasks.settings import SETTINGS

    holder = PipelineHolder(ModelOptions("tiny", model_cache=SETTINGS.model_cache))
    holder.load()
    req = validate_request({"prompt": "A red fox trotting through fresh snow", "seed": 3, "height": height,
                            "width": width, "num_frames": count, "num_inference_steps": 4},
                           Accepts(size_multiple=holder.size_multiple), max_prompt_chars=4000, max_work=10**13)
    return holder.generate(req)


def options(params: str) -> dict:
    """libx264's options for `params`, with the thread count it names given to libavcodec too (video.encode_mp4)."""
    return {**_X264, "threads": params.split(":")[0].removeprefix("threads="), "x264-params": params}


def dirty_heap(rng: np.random.Generator) -> None:
    """Leave freed heap blocks full of random bytes, where the encoder's next allocations will come from."""
    blocks = [rng.integers(0, 256, int(n), dtype=np.uint8) for n in rng.integers(1 << 16, 1 << 22, 24)]
    del blocks


@click.command()
@click.option("--size", default=REFERENCE_SIZE, show_default=True, callback=size_param, help="WIDTHxHEIGHT")
@click.option("--num-frames", default=DEFAULTS["num_frames"], show_default=True)
@click.option("--repeats", default=7, show_default=True, help="Encodes per content and setting.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Write the figures as JSON.")
def main(size, num_frames, repeats, out):
    width, height = size
    # Every allocation from the heap, none from fresh zeroed mmap pages: what a replica's process looks like.
    ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 1 << 30)
    settings = {"before: x264 as detected": "threads=1", "after: no AVX-512": x264_params(),
                "mbtree=0 instead": "threads=1:mbtree=0", "no AVX-512, 2 threads": x264_params(2),
                "no AVX-512, 4 threads": x264_params(4)}
    contents = {"tiny model": tiny_output(height, width, num_frames), "moving scene": scene(height, width, num_frames)}
    rng = np.random.default_rng(0)
    rows = []
    for content, frames in contents.items():
        reference = decode_mp4(encode_mp4(frames, 24, {"qp": "0", "preset": "veryfast", "x264-params": "threads=1"}))
        times = {name: [] for name in settings}
        digests = {name: set() for name in settings}
        for _ in range(repeats):
            for name, params in settings.items():
                dirty_heap(rng)
                start = time.perf_counter()
                data = encode_mp4(frames, 24, options(params))
                times[name].append(time.perf_counter() - start)
                digests[name].add(hashlib.sha256(data).hexdigest())
        for name, params in settings.items():
            data = encode_mp4(frames, 24, options(params))
            rows.append({"content": content, "setting": name, "x264_params": params,
                         "encode_ms": round(1000 * statistics.median(times[name]), 1), "bytes": len(data),
                         "psnr_db": round(psnr_db(decode_mp4(data), reference), 2),
                         "distinct_mp4s": len(digests[name]), "encodes": repeats})
    table = Table(title=f"libx264 at {width}x{height}x{num_frames}, CRF 18, veryfast")
    for col in ("content", "setting", "encode ms (median)", "bytes", "PSNR dB", "distinct MP4s"):
        table.add_column(col, justify="left" if col in ("content", "setting") else "right")
    for r in rows:
        table.add_row(r["content"], r["setting"], f"{r['encode_ms']:.1f}", f"{r['bytes']:,}", f"{r['psnr_db']:.2f}",
                      f"{r['distinct_mp4s']} of {r['encodes']}")
    Console(width=120).print(table)
    if out:
        out.write_text(json.dumps({"size": f"{width}x{height}", "num_frames": num_frames, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
