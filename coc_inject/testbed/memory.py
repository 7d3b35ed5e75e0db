"""How much memory a call takes: the bytes autograd keeps for backward (:class:`SavedBytes`), the
process's peak resident size over one call (:func:`resident_peak`, Linux: /proc/self), and the
device allocator's peak (:func:`peak_memory_mb`)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch


class SavedBytes:
    """``with SavedBytes() as saved: ...`` then ``saved.total``: the distinct storages autograd saved
    for backward inside the block (a storage saved twice counts once)."""

    def __init__(self):
        self._storages: dict = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        self._storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self._storages.values())


def unmap_freed_memory() -> None:
    """glibc: tensors over 64 KiB in their own mappings, unmapped when freed, so that the resident size
    follows the live tensors (by default freed memory stays resident and a peak is hidden)."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024)
    libc.mallopt(m_trim_threshold, 0)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def resident_peak(work, barrier) -> int:
    """Peak resident bytes of one call of work over the resident size around it (the smaller of before
    and after: memory another thread frees during the call would otherwise hide part of the peak)."""
    barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident size reset to the current one
    before = _status("VmRSS")
    work()
    peak = _status("VmHWM") - min(before, _status("VmRSS"))
    barrier()
    return peak


def peak_memory_mb(device) -> float | None:
    """This process's peak memory: the device allocator's on GPU / NPU, the resident set on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    if device.type == "npu":
        return torch.npu.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_memory(device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "npu":
        torch.npu.reset_peak_memory_stats(device)
