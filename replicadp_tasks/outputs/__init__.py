"""What a request leaves: its frames' identity and its MP4, bit-exact on any machine (video.py), and the output
store that keeps the MP4 beside its Result, in a folder, in Redis or in an S3 bucket (store.py)."""

from .store import delete_stored, fetch_video, open_store, sweep_forever, with_video_url
from .video import decode_mp4, encode_mp4, frames_sha256, poster_jpeg

__all__ = ["decode_mp4", "delete_stored", "encode_mp4", "fetch_video", "frames_sha256", "open_store",
           "poster_jpeg", "sweep_forever", "with_video_url"]
