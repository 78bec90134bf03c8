"""The ``gridshard`` command line.

    gridshard train [CONFIG] [--nproc N] [--run-dir DIR] [--resume PATH|latest] [--max-restarts N]
                    [--overwrite] [key.sub=value ...]
    gridshard export CKPT_DIR --to hf OUT_DIR
    gridshard plan [CONFIG] --gpus N [--nodes K] [--hardware NAME|PROFILE.json] [--top K] [--json] [--write OUT.yaml]
                   [--explain] [key.sub=value ...];  gridshard plan --calibrate [--nproc N] [--out PROFILE.json]
    gridshard plot RUN_DIR [--out DIR]
    gridshard diagnose RUN_DIR [--json] [--hardware NAME|PROFILE.json]
    gridshard prepare-data INPUT... --out DIR [--train-tokenizer --vocab-size N | --tokenizer FILE | --bytes]
                           [--overwrite]
    gridshard generate RUN_DIR|CKPT_DIR --prompt TEXT [--max-new-tokens N --temperature T --top-k K --seed S]

``train`` validates the whole config against the world size first (``--nproc``, or
``WORLD_SIZE`` under torchrun) — and, when resuming, the checkpoint's completeness and
compatibility — and exits with status 2 and one message on a bad config, before any
worker starts. A worker that dies ends the job with status 1 and a message naming the
rank and the last complete checkpoint. A run directory belongs to one live run: the launcher (rank 0
under torchrun) locks ``RUN_DIR/.gridshard.lock`` for the life of the job and a second ``train``
into it is refused, ``--overwrite`` included (gridshard/run_lock.py); the launcher's workers die
with it, SIGKILL included (gridshard/parent_death.py). A refused command creates nothing.

Exit status: 0 done; 2 refused before any worker started (config, data, run directory);
1 a worker died (signal), stalled (named from its heartbeat and killed after
``train.collective_timeout_s``) or the job failed after launch; 3 a worker raised an error —
one line names the rank and the cause, the traceback is in ``RUN_DIR/logs/rank_N.log``;
130 interrupted (Ctrl-C / SIGINT / SIGTERM): the current step ends, a checkpoint of it is
written, "stopped at step N; checkpoint ...", no traceback; a second Ctrl-C stops at once.

The package: main.py (the click group), train.py (``train``: local launch, signals),
preflight.py (every check before a worker starts), run_dir.py (the run-directory claim),
failures.py (failure and stop messages), commands.py (the other commands), common.py (exit
statuses). Here only what outside code imports.
"""
from .common import EXIT_CONFIG
from .failures import last_good_checkpoint, stopped_message, write_rank_log
from .main import main
from .preflight import _check_resume

__all__ = ["EXIT_CONFIG", "main", "last_good_checkpoint", "stopped_message", "write_rank_log", "_check_resume"]
