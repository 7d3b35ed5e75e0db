"""How many bytes autograd keeps for backward inside a block of code."""

from __future__ import annotations

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
