"""Frames to identities and MP4 bytes.

The decoded frames are the primary identity of an output (`frames_sha256`); the MP4 bytes are the second
(`video_sha256`), encoded bit-exact: the same frames give the same bytes in any process, from any buffer.

Why libx264 runs without its AVX-512 code: on a CPU with AVX-512, x264 uses AVX-512 versions of its
macroblock-tree routines, and at widths that are not a multiple of 128 pixels (a row of 8 lowres macroblocks)
these read heap memory that x264 allocated and never wrote. Those values feed the rate control, so the bytes
depend on what the heap held before: in a replica, where torch's large frees have raised glibc's mmap
threshold, a previous request's data. One encoder thread and `+bitexact` do not change that.

Why the fix holds: x264 keeps its settings and its own CPU detection, less the AVX-512 flag, and its AVX2 code
reads only what it wrote (tests/test_isolation.py fills new heap blocks with other bytes and finds the same MP4).
An AVX-512 machine then writes what x264 writes on an AVX2 one. Where libx264 is no shared library this process
can find, `mbtree=0` turns the macroblock tree off instead: as reproducible, larger files at the same CRF.
Measurements: docs/isolation.md and docs/benchmarks.md (figure 7).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import io

import numpy as np

X264_CPU_AVX512 = 1 << 16  # x264.h: the flag that selects x264's AVX-512 routines
# In-process libx264 through PyAV: no ffmpeg process to spawn per request (docs/benchmarks.md, figure 1). A thread
# count the caller fixes, never x264's own (1.5 x the machine's cores): frame threads change the bytes, and x264
# writes the count into the stream. A bitexact muxer: it would write its version.
_X264 = {"crf": "18", "preset": "veryfast"}


def frames_sha256(frames: np.ndarray) -> str:
    """sha256 over the uint8 frames and their shape, so a reshaped or cropped video never collides."""
    assert frames.dtype == np.uint8
    h = hashlib.sha256(f"uint8{tuple(frames.shape)}".encode())
    h.update(np.ascontiguousarray(frames).data)  # the buffer itself: no copy of a 40 MB video
    return h.hexdigest()


def loaded_library(name: str) -> str | None:
    """The path of a shared library this process has loaded whose file name starts with `name`, or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux
        return None
    return next((p for p in sorted(paths) if p.rsplit("/", 1)[-1].startswith(name)), None)


@functools.cache
def x264_params(threads: int = 1) -> str:
    """libx264's parameters: `threads` frame threads, and x264's own CPU detection less AVX-512 (see the module
    docstring)."""
    import av

    av.codec.Codec("libx264", "w")  # libavcodec is loaded, and with it libx264 (or: no such encoder, named)
    path = loaded_library("libx264")
    if path is None:
        return f"threads={threads}:mbtree=0"
    detect = ctypes.CDLL(path).x264_cpu_detect
    detect.restype = ctypes.c_uint32
    return f"threads={threads}:asm={detect() & ~X264_CPU_AVX512}"


def encode_mp4(frames: np.ndarray, fps: int, options: dict | None = None, threads: int = 1) -> bytes:
    """H.264 MP4 of uint8 frames shaped (frames, height, width, 3), byte-for-byte reproducible for a given
    `threads` (x264's frame threads: the same count gives the same bytes on any machine, another count other
    bytes). `options` replaces libx264's (bench/encode.py compares settings); replicas never pass it."""
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        options = options or {**_X264, "threads": str(threads), "x264-params": x264_params(threads)}
        stream = container.add_stream("libx264", rate=fps, options=options)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
        container.mux(stream.encode())  # flush
    return buf.getvalue()


def decode_mp4(data: bytes) -> np.ndarray:
    """Decode MP4 bytes to uint8 frames (frames, height, width, 3); for clients and tests."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def poster_jpeg(video: bytes, longest: int) -> bytes:
    """A JPEG of an MP4's first frame, scaled to at most `longest` pixels on its long side (aspect kept)."""
    import av

    with av.open(io.BytesIO(video)) as container:
        frame = next(container.decode(video=0)).to_image()
    frame.thumbnail((longest, longest))
    out = io.BytesIO()
    frame.save(out, format="JPEG", quality=80)
    return out.getvalue()
