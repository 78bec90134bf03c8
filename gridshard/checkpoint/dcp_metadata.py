"""DCP's ``.metadata`` of a checkpoint, unpickled through an allow-list: only the classes that
describe tensor chunks are built, and every entry must be a tensor (:func:`read_dcp_metadata`,
:class:`SafeMetadataReader`) — nothing in a checkpoint runs code when it is read.
"""
from __future__ import annotations

import os
import pickle

from torch.distributed.checkpoint import FileSystemReader

from .manifest import _open_nofollow
from .verify import Refused, _refused


# ---- DCP's .metadata, unpickled through an allow-list ------------------------------------------
# Exactly the classes DCP pickles to describe tensor chunks (a ``Metadata`` of
# ``TensorStorageMetadata`` entries, traced from a real gridshard checkpoint), torch dtypes
# (added in find_class) and a few inert containers. Not "every class of DCP's metadata module":
# that admits ``BytesStorageMetadata``, an entry DCP's default planner loads with
# ``torch.load(weights_only=False)`` — arbitrary code.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},       # a torch.layout by its name, from a fixed table
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},    # StorageMeta.checkpoint_id (the folder it was saved in)
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "dict", "list", "tuple"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        import torch

        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{str(module)[:80]}.{str(name)[:80]} is not allowed in a checkpoint's .metadata")


def read_dcp_metadata(folder: str):
    """DCP's ``.metadata`` of ``folder`` through the allow-list, every entry a tensor;
    raises :class:`Refused`."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = os.path.join(str(folder), ".metadata")
    try:
        with _open_nofollow(path) as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise Refused(".metadata is missing") from None
    except Exception as e:      # noqa: BLE001 - anything an allowed class raises on hostile arguments
        raise Refused(f".metadata cannot be read safely ({type(e).__name__}: {str(e)[:160]})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise Refused(".metadata does not hold DCP's index of tensors")
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise Refused(f".metadata entry {str(fqn)[:80]!r} is a {type(md).__name__}, not a tensor: gridshard "
                          f"checkpoints hold tensors only (DCP would unpickle a non-tensor entry with "
                          f"torch.load(weights_only=False), which can run code)")
    return metadata


class SafeMetadataReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` is unpickled through the allow-list above and holds
    tensors only (no arbitrary code runs on load). Readers use it through
    :mod:`gridshard.checkpoint.reader`, which checks the rest before loading."""

    def read_metadata(self, *args, **kwargs):
        return self._with_load_id(_refused(read_dcp_metadata, str(self.path)))

    def _with_load_id(self, metadata):
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
