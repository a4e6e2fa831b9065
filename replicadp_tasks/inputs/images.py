"""The optional first frame (`image`): fetched, bounded and decoded before the model sees it."""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from pathlib import Path
from typing import Callable, Sequence

from ..contract.errors import FetchError, ImageInputError
from .fetch import fetch


def _refused(value: str, why: str) -> ImageInputError:
    return ImageInputError(f"image={value!r}: {why}", "image", repr(value))


# A first frame has at most a few megapixels; anything larger is a decompression bomb, not a frame.
MAX_PIXELS = 40_000_000


def _read_bytes(image: str, max_bytes: int, timeout_s: int, image_dir: Path | None, allow_nets: Sequence,
                cancelled: Callable[[], bool] | None) -> bytes:
    """Bytes behind `image`: an http(s) URL (fetch.py's policy), a base64 data URI, raw base64, or a path under
    image_dir."""
    if image.startswith(("http://", "https://")):
        try:
            data = fetch(image, max_bytes=max_bytes, deadline_s=timeout_s, allow_nets=allow_nets,
                         cancelled=cancelled)
        except FetchError as exc:
            raise ImageInputError(str(exc), exc.field, exc.value) from None
    elif image.startswith("data:"):
        header, _, payload = image.partition(",")
        if ";base64" not in header:
            raise _refused(image[:40], "only base64 data URIs are accepted")
        data = _b64(payload, max_bytes)
        if data is None:
            raise _refused(image[:40], "invalid base64 in data URI")
    elif "://" in image:
        raise _refused(image[:80], "scheme not allowed; use http(s), data: or base64")
    else:
        data = _b64(image, max_bytes)
        if data is None:
            # Not base64 (a file name has a '.'): a local path, allowed only under REPLICADP_IMAGE_DIR.
            if image_dir is None:
                raise _refused(image[:80], "neither base64 nor a URL, and local paths are refused unless "
                               "REPLICADP_IMAGE_DIR is set") from None
            data = _local(image_dir, image, max_bytes)
    if len(data) > max_bytes:
        raise ImageInputError.of("image", f"more than {max_bytes} bytes (REPLICADP_MAX_IMAGE_BYTES)")
    return data


def _b64(payload: str, max_bytes: int) -> bytes | None:
    """Decoded base64, or None if `payload` is not base64."""
    if len(payload) > max_bytes * 4 // 3 + 4:
        raise ImageInputError.of("image", f"more than {max_bytes} bytes (REPLICADP_MAX_IMAGE_BYTES)")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None


def _local(image_dir: Path, image: str, max_bytes: int) -> bytes:
    if "\x00" in image or len(image) > 4096:
        raise _refused(image[:80], "not a usable path")
    path = (image_dir / image).resolve()
    if not path.is_relative_to(image_dir):
        raise _refused(image[:80], "outside REPLICADP_IMAGE_DIR")
    try:
        with open(path, "rb") as f:
            return f.read(max_bytes + 1)
    except OSError as exc:
        raise _refused(image[:80], exc.strerror or type(exc).__name__) from exc  # not the resolved path


def load_first_frame(image: str, width: int, height: int, *, max_bytes: int, timeout_s: int,
                     image_dir: Path | None, allow_nets: Sequence = (), cancelled: Callable[[], bool] | None = None):
    """Return (PIL RGB image resized to width x height, sha256 of the source bytes). A URL may reach networks
    that are not public only inside `allow_nets`; `cancelled()` True stops its download (RequestCancelled)."""
    from PIL import Image

    data = _read_bytes(image, max_bytes, timeout_s, image_dir, allow_nets, cancelled)
    try:
        with Image.open(io.BytesIO(data)) as probe:
            if probe.width * probe.height > MAX_PIXELS:
                raise ImageInputError.of("image", f"{probe.width}x{probe.height} is more than {MAX_PIXELS} pixels")
        img = Image.open(io.BytesIO(data)).convert("RGB")
    except ImageInputError:
        raise
    except Exception as exc:  # PIL raises many types for corrupt data
        # Only the exception's type: PIL's messages carry the repr of the buffer (a heap address of the replica).
        raise ImageInputError.of("image", f"cannot decode as an image ({type(exc).__name__})") from exc
    return img.resize((width, height), Image.Resampling.BICUBIC), hashlib.sha256(data).hexdigest()
