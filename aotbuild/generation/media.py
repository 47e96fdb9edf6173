"""Images and videos in and out: pictures a call starts from, decoded and checked; what a pipeline
makes, encoded: PNG images, MP4 videos (diffusers' `export_to_video`, imageio with its ffmpeg:
the `video` extra). `aotbuild run` reads and writes them, `aotbuild serve` takes and returns them."""

from __future__ import annotations

import inspect
import io
import tempfile
from pathlib import Path
from typing import Any

from ..errors import AotbuildError

VIDEO_FPS = 16  # Wan's frame rate, for pipelines whose call names none
MAX_PICTURE_PIXELS = 4096 * 4096  # a picture taken in, checked from its header before it is decoded


def read_picture(data: bytes, what: str, mode: str = "RGB") -> Any:
    """A PNG, JPEG or WebP (any format PIL reads) as a PIL image in `mode` ("L" for a mask).

    Raises:
        AotbuildError: not an image PIL can read, or more than MAX_PICTURE_PIXELS pixels (a
            decompression bomb is refused from its header, before its pixels are decoded).
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as picture:
            if picture.width * picture.height > MAX_PICTURE_PIXELS:
                raise AotbuildError(f"{what} is {picture.width}x{picture.height} px; at most "
                                    f"{MAX_PICTURE_PIXELS} pixels are taken")
            return picture.convert(mode)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise AotbuildError(f"{what} is not an image PIL can read ({exc})") from None


def png_bytes(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def video_fps(pipeline_class: type) -> int:
    """The frame rate a pipeline's videos play at: its call's `frame_rate` (LTX-Video's 25), else Wan's 16."""
    parameter = inspect.signature(pipeline_class.__call__).parameters.get("frame_rate")
    return parameter.default if parameter is not None and isinstance(parameter.default, int) else VIDEO_FPS


def check_video_writer() -> None:
    """Raise, before any video is made, where no MP4 can be written."""
    try:
        import imageio  # noqa: F401  (diffusers falls back to OpenCV without it, warning only)
        import imageio_ffmpeg  # noqa: F401
    except ImportError:
        raise AotbuildError("writing an MP4 needs imageio and imageio-ffmpeg",
                            hint="pip install imageio imageio-ffmpeg") from None


def write_video(frames: list[Any], path: Path, fps: int) -> None:
    """An MP4 of the frames (PIL images) at `path`."""
    check_video_writer()
    from diffusers.utils import export_to_video

    export_to_video(frames, str(path), fps=fps)


def mp4_bytes(frames: list[Any], fps: int) -> bytes:
    """The MP4 of the frames, as bytes (ffmpeg writes to a file)."""
    with tempfile.TemporaryDirectory(prefix="aotbuild-video-") as folder:
        path = Path(folder) / "video.mp4"
        write_video(frames, path, fps)
        return path.read_bytes()
