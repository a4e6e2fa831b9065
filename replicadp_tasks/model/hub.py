"""A hub model's files, fetched before it loads. A replica's first start downloads gigabytes: it says so in its log
(the `replicadp` logger, so JSON in JSON logs), how far it has got, and when the cache already holds the model."""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("replicadp")
REPORT_EVERY_PERCENT = 10  # a line per tenth of the bytes, whatever the model's size
REPORT_EVERY_S = 30.0  # and one at least this often, so that a slow download is seen to move
# Weight formats that from_pretrained reads only from a folder without safetensors. The diffusers Wan repos ship
# safetensors (some beside .bin or .pth copies), so these would be gigabytes downloaded for nothing.
PICKLED = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.msgpack", "*.h5", "*.onnx", "*.onnx_data"]


def download(repo_id: str) -> str:
    """The local folder of hub model `repo_id`, whose files are downloaded first unless the cache holds them; with
    HF_HUB_OFFLINE=1, the cache's or an error, nothing downloaded."""
    from huggingface_hub import hf_hub_download, is_offline_mode, snapshot_download

    # 1. What from_pretrained reads: model_index.json and the folders of the components it names (an absent
    #    optional component, such as Wan2.2-TI2V's transformer_2, is [null, null]).
    index = json.loads(Path(hf_hub_download(repo_id, "model_index.json", tqdm_class=_Bar)).read_text())
    components = [name for name, value in index.items()
                  if not name.startswith("_") and isinstance(value, list) and value and value[0]]
    files = {"allow_patterns": ["model_index.json", *(f"{name}/*" for name in components)],
             "ignore_patterns": PICKLED, "tqdm_class": _Bar}
    if is_offline_mode():
        path = snapshot_download(repo_id, **files)
        log.info("model %s: in the cache (offline: HF_HUB_OFFLINE=1), %s", repo_id, path)
        return path
    # 2. What the cache lacks (a dry run asks the hub for the file list and sizes, and downloads nothing).
    missing = [f for f in snapshot_download(repo_id, dry_run=True, **files) if f.will_download]
    if not missing:
        path = snapshot_download(repo_id, **files)
        log.info("model %s: already in the cache, %s", repo_id, path)
        return path
    # 3. Download it, with progress lines.
    progress = Progress(repo_id, total_bytes=sum(f.file_size or 0 for f in missing), total_files=len(missing))
    log.info("model %s: downloading %d files, %s", repo_id, len(missing), _size(progress.total_bytes))
    path = snapshot_download(repo_id, **{**files, "tqdm_class": progress.bar_class()})
    elapsed = time.monotonic() - progress.started
    log.info("model %s: downloaded %d files, %s in %.1f s (%s/s), %s", repo_id, len(missing),
             _size(progress.total_bytes), elapsed, _size(progress.total_bytes / max(elapsed, 1e-3)), path)
    return path


class Progress:
    """One download's progress, counted by its progress bars (huggingface_hub's: bytes written, bytes received,
    files done, from its download threads) and logged every REPORT_EVERY_PERCENT % or REPORT_EVERY_S."""

    def __init__(self, repo_id: str, total_bytes: int, total_files: int):
        self.repo_id, self.total_bytes, self.total_files = repo_id, total_bytes, total_files
        self.started = self.reported = time.monotonic()
        self.bytes = self.files = 0
        self.next_percent = REPORT_EVERY_PERCENT
        self.lock = threading.Lock()

    def bar_class(self) -> type[tqdm]:
        """A progress bar class for snapshot_download's `tqdm_class`, whose bars count for this download."""
        return type("Bar", (_Bar,), {"progress": self})

    def counted(self, bar: tqdm) -> None:
        """`bar` has counted more: log a line if one is due. Bytes done are the most any byte bar has counted:
        huggingface_hub counts the bytes written and the bytes received (fewer, with Xet's deduplication)."""
        with self.lock:
            if bar.unit == "B":
                self.bytes = max(self.bytes, min(int(bar.n), self.total_bytes))
            else:
                self.files = int(bar.n)
            now = time.monotonic()
            percent = 100 * self.bytes // self.total_bytes if self.total_bytes else 0
            if self.bytes >= self.total_bytes or (percent < self.next_percent and now - self.reported < REPORT_EVERY_S):
                return  # complete: download() says so
            self.next_percent = (percent // REPORT_EVERY_PERCENT + 1) * REPORT_EVERY_PERCENT
            self.reported = now
            log.info("model %s: %s of %s downloaded (%d%%, %d of %d files), %s/s", self.repo_id, _size(self.bytes),
                     _size(self.total_bytes), percent, self.files, self.total_files,
                     _size(self.bytes / max(now - self.started, 1e-3)))


class _Nowhere(io.TextIOBase):
    def write(self, text: str) -> int:
        return len(text)


class _Bar(tqdm):
    """A progress bar that draws nothing (a log is no terminal); a subclass's bars count for its Progress."""

    progress: Progress | None = None
    monitor_interval = 0  # tqdm's monitor thread only redraws bars

    def __init__(self, *args, **kwargs):
        kwargs.pop("name", None)  # huggingface_hub's bars have one; tqdm takes none
        super().__init__(*args, **{**kwargs, "file": _Nowhere(), "disable": False})

    def update(self, n=1):
        drawn = super().update(n)
        if self.progress is not None:
            self.progress.counted(self)
        return drawn


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
