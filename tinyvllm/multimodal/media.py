"""Loading media for multimodal prompts: images with Pillow, video files with PyAV.

Sources are local: a path, a `file://` URL, raw bytes or a `data:` URL (what OpenAI-style
`image_url` parts carry inline). Remote http(s) URLs are refused rather than fetched, so a
prompt never makes the engine reach the network. PyAV is optional (`tinyvllm[video]`);
frames already in memory need neither.
"""

from __future__ import annotations

import base64
import binascii
import io
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse
from urllib.request import url2pathname

import numpy as np

if TYPE_CHECKING:
    from PIL import Image

MediaSource = str | Path | bytes


@dataclass(frozen=True)
class VideoClip:
    """Decoded RGB frames (T, H, W, 3) uint8 and the frame rate of those frames (None when
    the container does not say); the rate sets Qwen2.5-VL's temporal position spacing."""

    frames: np.ndarray
    fps: float | None


def _data_url_bytes(url: str) -> bytes:
    header, _, payload = url.partition(",")
    if not header.endswith(";base64"):
        return unquote(payload).encode("latin-1")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"data URL {url[:40]!r}... has invalid base64 content") from None


def resolve_media(source: MediaSource, what: str) -> Path | bytes:
    """A local path or in-memory bytes for `source`; errors name the source and the fix."""
    if isinstance(source, bytes):
        return source
    if isinstance(source, Path):
        path = source
    else:
        scheme = urlparse(source).scheme.lower()
        if scheme == "data":
            return _data_url_bytes(source)
        if scheme in ("http", "https"):
            raise ValueError(
                f"{what} {source!r}: remote URLs are not fetched; download the file and pass "
                "its local path or a file:// URL"
            )
        # Drive letters ("C:\\...") parse as one-letter schemes: treat them as paths.
        path = Path(url2pathname(urlparse(source).path)) if scheme == "file" else Path(source)
    path = path.expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{what} file {str(path)!r} does not exist")
    return path


def load_image(source: MediaSource | Image.Image, max_pixels: int | None = None) -> Image.Image:
    """An image from a path, file:// URL, bytes or data: URL, fully decoded (the file is
    closed on return). Mode conversion is left to the processor (it composites alpha).
    Pillow's decompression-bomb guard stays on; `max_pixels` (width x height) is checked from
    the header, before anything is decoded."""
    # Here, not at the top: every engine imports this module, few of them see an image
    # (Pillow's import is ~15 ms of a start).
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return source
    media = resolve_media(source, "image")
    name = "the given bytes" if isinstance(media, bytes) else str(media)
    try:
        with Image.open(io.BytesIO(media) if isinstance(media, bytes) else media) as image:
            check_pixels(image.width, image.height, max_pixels, f"image {name!r}")
            image.load()
            return image
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as exc:
        raise ValueError(f"could not decode image {name!r}: {exc}") from None


def check_pixels(width: int, height: int, max_pixels: int | None, what: str) -> None:
    """ValueError when a width x height picture is over `max_pixels` (None: no bound)."""
    if max_pixels is not None and width * height > max_pixels:
        raise ValueError(
            f"{what} is {width}x{height} = {width * height} pixels, more than the "
            f"{max_pixels} allowed; send a smaller one"
        )


def _import_av():  # type: ignore[no-untyped-def]
    try:
        import av
    except ImportError:
        raise ImportError(
            "decoding video files needs PyAV, which is not installed: "
            "pip install 'tinyvllm[video]' (or pass the frames as a (T, H, W, 3) uint8 array)"
        ) from None
    return av


def _sample_indices(total: int, num_frames: int | None) -> np.ndarray:
    if num_frames is None or num_frames >= total:
        return np.arange(total)
    # Evenly spread over the clip, first and last frame included.
    return np.unique(np.linspace(0, total - 1, num_frames).round().astype(np.int64))


def decode_video(
    source: MediaSource,
    num_frames: int | None = None,
    max_frames: int | None = None,
    max_pixels: int | None = None,
) -> VideoClip:
    """Decode a video file's first video stream to RGB frames; with `num_frames`, keep that
    many frames spread evenly over the clip (fps scales with them). A clip of more than
    `max_frames` frames (decoded, not kept), or with frames over `max_pixels`, is a
    ValueError, raised as soon as the header or the decoding shows it."""
    if num_frames is not None and num_frames < 1:
        raise ValueError(f"num_frames={num_frames} must be at least 1 (or None for all)")
    av = _import_av()
    media = resolve_media(source, "video")
    name = "the given bytes" if isinstance(media, bytes) else str(media)

    def opened() -> Any:
        return av.open(io.BytesIO(media) if isinstance(media, bytes) else str(media))

    try:
        with opened() as container:
            if not container.streams.video:
                raise ValueError(f"{name!r} has no video stream")
            stream = container.streams.video[0]
            total = stream.frames
            if not total and num_frames is not None:
                # The container does not state its length (e.g. Matroska): count the packets
                # (no decoding), so only the sampled frames are converted below.
                with opened() as counting:
                    total = _count_packets(counting, max_frames, name)
            _check_clip(stream.codec_context, total, max_frames, max_pixels, name)
            rate = float(stream.average_rate) if stream.average_rate else None
            # Convert only the sampled frames (a long clip's full RGB frames would not fit in
            # memory); with no length known, every frame is kept and sampled afterwards.
            wanted = set(_sample_indices(total, num_frames).tolist())
            frames, decoded = [], 0
            for index, frame in enumerate(container.decode(stream)):
                decoded += 1
                _check_clip(frame, decoded, max_frames, max_pixels, name)
                if not wanted or index in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except av.error.FFmpegError as exc:
        raise ValueError(f"could not decode video {name!r}: {exc}") from None
    if not frames:
        raise ValueError(f"video {name!r} has zero frames")
    if not wanted:
        frames = [frames[i] for i in _sample_indices(len(frames), num_frames)]
    fps = None if rate is None else rate * len(frames) / decoded
    return VideoClip(frames=np.stack(frames), fps=fps)


def _count_packets(container: Any, max_frames: int | None, name: str) -> int:
    """Frames of the first video stream, counted from its packets without decoding them."""
    count = 0
    for packet in container.demux(container.streams.video[0]):
        count += packet.size > 0  # the flush packet at the end is empty
        _check_clip(None, count, max_frames, None, name)
    return count


def _check_clip(
    frame: Any, count: int, max_frames: int | None, max_pixels: int | None, name: str
) -> None:
    """The bounds on a clip of `count` frames (so far, or as the header says) sized like
    `frame` (a frame or the stream's codec context: anything with width and height)."""
    if max_frames is not None and count > max_frames:
        raise ValueError(
            f"video {name!r} has more than the {max_frames} frames allowed; send a shorter clip"
        )
    if frame is not None:
        check_pixels(frame.width, frame.height, max_pixels, f"a frame of video {name!r}")


def load_video(source: MediaSource, num_frames: int | None = None) -> np.ndarray:
    """RGB frames (T, H, W, 3) uint8 of a video file (see `decode_video`)."""
    return decode_video(source, num_frames).frames
