"""Frames to identities and MP4 bytes.

The decoded frames are the primary identity of an output (`frames_sha256`); the MP4 bytes are the second
(`video_sha256`), encoded bit-exact so that the same frames give the same bytes on any machine.
"""

from __future__ import annotations

import hashlib
import os
import tempfile

import numpy as np

# libx264 writes its thread count into the stream; one thread and bitexact flags make the bytes a
# function of the frames alone.
_BITEXACT = ["-threads", "1", "-x264-params", "threads=1", "-fflags", "+bitexact",
             "-flags:v", "+bitexact", "-map_metadata", "-1"]


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """Float frames in [0, 1] (what the pipeline returns with output_type="np") to uint8."""
    return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def frames_sha256(frames: np.ndarray) -> str:
    """sha256 over the uint8 frames and their shape, so a reshaped or cropped video never collides."""
    assert frames.dtype == np.uint8
    h = hashlib.sha256(f"uint8{tuple(frames.shape)}".encode())
    h.update(np.ascontiguousarray(frames).data)  # the buffer itself: no copy of a 40 MB video
    return h.hexdigest()


def encode_mp4(frames: np.ndarray, fps: int) -> bytes:
    """H.264 MP4 of uint8 frames shaped (frames, height, width, 3), byte-for-byte reproducible."""
    import imageio_ffmpeg

    n, height, width, _ = frames.shape
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        writer = imageio_ffmpeg.write_frames(
            path, (width, height), fps=fps, codec="libx264", pix_fmt_out="yuv420p",
            macro_block_size=1, quality=None, output_params=["-crf", "18", "-preset", "veryfast", *_BITEXACT],
            ffmpeg_log_level="error",
        )
        writer.send(None)
        for frame in frames:
            writer.send(np.ascontiguousarray(frame))
        writer.close()
        with open(path, "rb") as f:
            return f.read()
    finally:
        os.unlink(path)


def decode_mp4(data: bytes) -> np.ndarray:
    """Decode MP4 bytes to uint8 frames (frames, height, width, 3); for clients and tests."""
    import imageio_ffmpeg

    fd, path = tempfile.mkstemp(suffix=".mp4")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        reader = imageio_ffmpeg.read_frames(path)
        meta = next(reader)
        width, height = meta["size"]
        frames = [np.frombuffer(buf, np.uint8).reshape(height, width, 3) for buf in reader]
        return np.stack(frames) if frames else np.zeros((0, height, width, 3), np.uint8)
    finally:
        os.unlink(path)
