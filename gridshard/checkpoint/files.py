"""The checkpoint folder on disk: names, the ``latest`` pointer, the manifest, verification.

::

    RUN_DIR/checkpoints/
        step_20/                 complete checkpoints only
            .metadata            DCP's index of chunks (read through an allow-list)
            __0_0.distcp …       each rank's chunks (DCP files)
            meta.json            step, tokens, data position, scaler, layout, resolved config
            manifest.json        every file above: size and sha256 — written last
        step_30/
        step_40.partial/         a save in progress (or killed): never read
        latest                   "step_30": the newest complete checkpoint, replaced atomically

Visibility rule: a save writes into ``step_N.partial/``; when every rank's data and DCP's
``.metadata`` are on disk, rank 0 writes ``meta.json`` and then ``manifest.json``, fsyncs,
renames the folder to ``step_N`` and only then replaces ``latest`` (write ``latest.tmp``,
``os.replace``). A crash at any point therefore leaves either no ``step_N`` or a complete
one, and ``latest`` never names an incomplete folder. Loading verifies the manifest first
(every file present, of its size, with its hash) and refuses with a message naming the step,
the file and what is wrong — never a partial load.

Nothing in a checkpoint is unpickled freely: tensors are read by DCP with
``torch.load(weights_only=True)``, ``meta.json``/``manifest.json`` are JSON, and DCP's
``.metadata`` pickle goes through :class:`SafeMetadataReader`, whose unpickler only builds
the few classes that describe tensors (an allow-list, like ``weights_only``) and which
refuses any entry that is not a tensor. Every reader goes through
:mod:`gridshard.checkpoint.reader`, which adds the checks that need more than one file
(``meta.json`` against the tensors, chunk locations against the manifest).

Paths stay inside the checkpoints folder: ``latest`` must be a plain file holding a
``step_N`` name (no ``..``, no separators, no absolute path); a step folder, or a file in
it, that is a symbolic link is refused; the manifest and DCP's index may name only plain
file names of the folder. Refusals never print what a refused file holds.

The folder is written and read by four modules, each one thing — every name stays importable
from here (``from . import files as F`` in the checkpointer, reader, resume and export):

* :mod:`.folders` — names (``step_N``, ``latest``, ``.partial``), the ``latest`` pointer, resolving
  ``--resume``, publishing, pruning;
* :mod:`.manifest` — writing ``manifest.json`` (sizes, sha256) and ``meta.json``'s JSON;
* :mod:`.verify` — checking a folder against its manifest, reading ``meta.json``, the refusals;
* :mod:`.dcp_metadata` — DCP's ``.metadata`` through the allow-list.
"""
from __future__ import annotations

# ruff: noqa: F401 -- every name below is re-exported (private ones too: the reader uses F._verify, F._read_meta, F._plain_name,
# the checkpointer F._read_manifest; tests F._ALLOWED)
from ..errors import CheckpointError
from .dcp_metadata import _ALLOWED, SafeMetadataReader, read_dcp_metadata
from .folders import (CHECKPOINTS, FORMAT, LATEST, MANIFEST, META, PARTIAL, checkpoints_root, complete_steps, fsync_dir,
                      latest_or_none, prune, publish, read_latest, remove_partials, resolve_checkpoint, step_dir_name, update_latest)
from .manifest import describe_files, write_json, write_manifest
from .verify import (Refused, _plain_name, _read_manifest, _read_meta, _verify, check_folder, newest_verified,
                     read_meta, refusal, verify_checkpoint)
