"""An artifact's weights: read from safetensors with the memory layout the compiled code reads
them with, and checked before they are bound by pointer (AOTInductor checks no strides)."""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import CorruptArtifactError
from ..spec.private_apis import borrowed_mkldnn, mkldnn_memory, storage_at


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32: a dtype as targets and manifests name it."""
    return str(dtype).removeprefix("torch.")


def contiguous_strides(shape: Any) -> list[int]:
    strides, step = [], 1
    for size in reversed(list(shape)):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def same_strides(tensor: torch.Tensor, stride: list[int]) -> bool:
    """Whether `tensor` is laid out with `stride` (a dim of size 1 is never stepped over, so its
    stride does not matter)."""
    return tensor.ndim == len(stride) and all(
        size == 1 or got == want for size, got, want in zip(tensor.shape, tensor.stride(), stride, strict=True))


def same_layout(tensor: torch.Tensor, like: torch.Tensor, device: torch.device) -> bool:
    """Whether `tensor` can be bound where the compiled code reads `like`, on `device`, as it is:
    the same shape, dtype and strides."""
    return (tensor.shape == like.shape and tensor.dtype == like.dtype and tensor.device == device
            and same_strides(tensor, list(like.stride())))


def load_weights(path: Path, device: torch.device, layouts: dict[str, dict],
                 read_ahead: bool = True) -> dict[str, torch.Tensor]:
    """The constants of one component by FQN, each with the strides its compiled code reads.

    safetensors stores every tensor contiguous, so a constant compiled for another layout (NHWC
    convolution weights under channels_last) is stored in its memory order and viewed back here
    with its recorded shape and strides (`layouts`), with no copy. `read_ahead=False`: the values
    will not be read (another checkpoint's are bound), only the layouts.
    """
    from safetensors.torch import load_file

    if device.type == "cpu" and read_ahead:
        # safetensors maps the file and its pages are read when the first call touches them, in
        # the order the code reads them: ask the kernel to read the whole file ahead, in the
        # background, while the rest of the pipeline loads.
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)
    tensors = load_file(os.fspath(path), device=str(device))
    for fqn, layout in layouts.items():
        try:
            tensors[fqn] = tensors[fqn].as_strided(layout["shape"], layout["stride"])
        except (KeyError, RuntimeError) as exc:
            raise CorruptArtifactError(f"{path}: constant {fqn!r} cannot be laid out as the manifest records "
                                       f"({exc})") from None
    return tensors


def page_releaser(path: Path) -> Callable[[Iterable[torch.Tensor]], int]:
    """What takes weights' pages out of this process's memory: tensors of `path` as `load_weights`
    mapped it, that nothing has written to since, read once at load to make the constants the
    compiled code reads instead (oneDNN-packed weights, `optimize.prepack`), each as soon as it is
    packed (`CompiledVariant`'s `release`). A packed model otherwise holds both forms of every
    weight: Wan 2.1 1.3B's load peaked at 5.7 GiB, 2.2x its weights. The pages stay in the page
    cache, and a later read (a LoRA merged from the base weights, a constant made again) maps them
    back from the file; a page written since the mapping would lose the write, hence only as the
    weights are loaded. Pages a tensor shares with its neighbours stay. The function returns the
    bytes taken out (0 where the file is not mapped privately, or off Linux); `path`'s mappings are
    read once, here."""
    ranges = _private_mappings(path)
    if not ranges or not hasattr(mmap, "MADV_DONTNEED"):
        return lambda tensors: 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def release(tensors: Iterable[torch.Tensor]) -> int:
        page, released = mmap.PAGESIZE, 0
        for tensor in tensors:
            start = tensor.data_ptr()
            end = start + tensor.element_size() * (1 + sum((n - 1) * s for n, s in zip(
                tensor.shape, tensor.stride(), strict=True) if n > 0))
            first, last = -(-start // page) * page, end // page * page
            if last > first and any(low <= first and last <= high for low, high in ranges) \
                    and madvise(first, last - first, mmap.MADV_DONTNEED) == 0:
                released += last - first
        return released

    return release


def _private_mappings(path: Path) -> list[tuple[int, int]]:
    """The address ranges at which this process maps `path` privately (copy on write), from
    /proc/self/maps, matched by device and inode."""
    try:
        info = os.stat(path)
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return []
    device = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}"
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) >= 5 and fields[1].endswith("p") and fields[3] == device and fields[4] == str(info.st_ino):
            low, high = fields[0].split("-")
            ranges.append((int(low, 16), int(high, 16)))
    return ranges


def bindable(weights: dict[str, torch.Tensor], fqn: str, layouts: dict[str, dict], package: Path) -> torch.Tensor:
    """weights[fqn], checked to have the strides the compiled code reads it with: the binding is
    by pointer, and code compiled for NHWC strides reads a contiguous tensor's memory wrongly."""
    try:
        tensor = weights[fqn]
    except KeyError:
        raise CorruptArtifactError(f"{package}: the weights file lacks constant {fqn!r}") from None
    expected = layouts[fqn]["stride"] if fqn in layouts else contiguous_strides(tensor.shape)
    if not same_strides(tensor, expected):
        raise CorruptArtifactError(f"{package}: constant {fqn!r} has strides {list(tensor.stride())}; the compiled "
                                   f"code reads it with strides {expected}")
    return tensor


class Lender:
    """Views of tensors through storages that do not own their memory: what compiled models are
    given to bind by pointer, made once per distinct view and shared by every model of one load.

    torch 2.13 keeps each tensor it is given as a user-managed constant until the process ends
    (the handle AOTInductor makes of it is never freed; fixed upstream by pytorch#194480). Given
    the owner itself, that would keep its whole storage (a mapped weights file, a merge buffer)
    alive after the model is gone; given a borrowed view, only the view's few hundred bytes stay,
    and the memory goes when its owner does. The views are shared so that the bytes lost per load
    grow with the distinct constants, not with the models binding them, and binding the same
    tensor again (a LoRA switched back) loses nothing. Whoever binds keeps the owners alive for as
    long as a model may read them.
    """

    def __init__(self) -> None:
        self._storages: dict[tuple, Any] = {}
        self._views: dict[tuple, torch.Tensor] = {}

    def views(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each tensor as a borrowed view of the same memory, shape, strides and dtype."""
        return {name: self._view(tensor) for name, tensor in tensors.items()}

    def _view(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.is_mkldnn:  # a prepared constant (runtime.prepared): oneDNN's own memory, no storage
            key = (*mkldnn_memory(tensor), tensor.dtype, tuple(tensor.shape))
            if key not in self._views:
                self._views[key] = borrowed_mkldnn(tensor)
            return self._views[key]
        storage = tensor.untyped_storage()
        where = (storage.data_ptr(), storage.nbytes(), tensor.device)
        key = (*where, tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))
        view = self._views.get(key)
        if view is None:
            if where not in self._storages:
                self._storages[where] = storage_at(storage.data_ptr(), tensor.device, storage.nbytes())
            view = self._views[key] = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
                self._storages[where], tensor.storage_offset(), tensor.shape, tensor.stride())
        return view
