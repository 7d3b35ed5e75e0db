"""What the two Ascend backends share: finding and importing their library, lazily and safely."""

from __future__ import annotations

import importlib
import importlib.util


class NpuLibraryBackend:
    """A backend whose kernels live in an optional Python library for Ascend NPUs."""

    module: str  # the library's import name
    install_hint: str = ""
    required_attribute: str | None = None  # a symbol the library must have

    def __init__(self):
        self._library = None

    def unavailable(self) -> str | None:
        """Why this backend cannot run in this process at all, or None. Imports on first use only."""
        if self._library is None:
            try:
                if importlib.util.find_spec(self.module) is None:
                    return f"{self.module} is not installed{self.install_hint}"
                library = importlib.import_module(self.module)
            except Exception as error:  # a broken install must not stop training
                return f"importing {self.module} failed: {type(error).__name__}: {error}"
            if self.required_attribute and not hasattr(library, self.required_attribute):
                return f"{self.module} has no {self.required_attribute}"
            self._library = library
        return None

    @property
    def device_type(self) -> str:
        # The real libraries run on NPUs; a test fake declares the device type it emulates.
        return getattr(self._library, "COC_FAKE_DEVICE_TYPE", "npu")

    def placement_unsupported(self, op: str, x, size: int, kernel: str) -> str | None:
        """Why ``kernel`` cannot take ``x`` where it lies, or how it splits: both libraries' last checks."""
        if x.device.type != self.device_type:
            return f"tensors on {x.device.type}, {kernel} runs on {self.device_type}"
        if op == "matmul_reduce_scatter" and x.shape[0] % size:
            return f"m={x.shape[0]} rows do not divide by the tensor-parallel size {size}"
        return None
