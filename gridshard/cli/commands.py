"""The ``gridshard`` commands other than ``train``: ``plan``, ``emulate``, ``export``, ``plot``, ``diagnose``,
``generate``, ``predict`` and ``prepare-data``. Each declares its options and hands over to
its subsystem, imported when the command runs."""
from __future__ import annotations

import click

from ..errors import ConfigError
from .common import _refused_as, _split_args


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, metavar="[CONFIG] [key.sub=value ...]")
@click.option("--gpus", type=int, default=None, help="Devices N to plan for (default: the config's D×P×T).")
@click.option("--nodes", type=int, default=None, help="Nodes the N devices are spread over (default: ⌈N / devices "
              "per node of --hardware⌉).")
@click.option("--hardware", default="cpu", show_default=True,
              help="h100 | h200 | a100 | cpu | calibrated | PROFILE.json (from --calibrate).")
@click.option("--top", type=int, default=10, show_default=True, help="Layouts to show.")
@click.option("--json", "as_json", is_flag=True, help="Print the layouts as a JSON list, best first.")
@click.option("--write", type=click.Path(dir_okay=False), default=None,
              help="Write the input config with the best layout's parallel:/train: keys to this YAML file.")
@click.option("--explain", "explain_flag", is_flag=True, help="Say why the top layout wins.")
@click.option("--calibrate", "calibrate_flag", is_flag=True, help="Measure this machine (GEMM, memory, "
              "collectives over --nproc local ranks) and write a profile for --hardware.")
@click.option("--nproc", type=int, default=4, show_default=True, help="Ranks for --calibrate.")
@click.option("--out", default="gridshard-profile.json", show_default=True, help="Profile file of --calibrate.")
@click.option("--emulate", "emulate_top", type=int, default=0, help="Emulate the first and last rank of the top K "
              "layouts on this device (gridshard emulate) and re-rank them with the measured compute and peak.")
def plan(args, gpus, nodes, hardware, top, as_json, write, explain_flag, calibrate_flag, nproc, out, emulate_top):
    """Rank every layout of CONFIG on N devices by predicted step time (docs/planner.md).

    \b
      gridshard plan configs/tiny.yaml --gpus 8 --explain
      gridshard plan --gpus 64 --nodes 8 --hardware h100 model.preset=7b data.seq_len=4096
      gridshard plan --calibrate --nproc 4 --out cpu.json && gridshard plan --gpus 4 --hardware cpu.json
    """
    from ..planner.command import run_calibrate, run_plan

    with _refused_as("gridshard plan: "):
        source, overrides = _split_args(args)
        if calibrate_flag:
            run_calibrate(nproc, out, overrides)          # parallel.backend=... picks the backend
            return
        run_plan(source, overrides, gpus, nodes, hardware, top, as_json, write, explain_flag, emulate_top)


@click.command()
@click.argument("ckpt_dir", type=click.Path(file_okay=False))
@click.option("--to", "fmt", type=click.Choice(["hf"]), required=True, help="Output format: hf (safetensors + "
              "config.json for transformers' LlamaForCausalLM).")
@click.argument("out_dir", type=click.Path(file_okay=False))
def export(ckpt_dir, fmt, out_dir):
    """Write checkpoint CKPT_DIR (a step_N folder, a run directory or its checkpoints folder) as
    consolidated Hugging Face weights in OUT_DIR."""
    from ..checkpoint import resolve_checkpoint
    from ..checkpoint.hf_io import export_hf

    with _refused_as():
        paths = export_hf(resolve_checkpoint(ckpt_dir, None), out_dir)
    click.echo("\n".join(paths))


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--out", type=click.Path(file_okay=False), default=None, help="Folder for the PNGs (default: RUN_DIR).")
def plot(run_dir, out):
    """Write loss.png and throughput.png for RUN_DIR (from its metrics.jsonl)."""
    from ..plot import plot_run

    with _refused_as():
        paths = plot_run(run_dir, out)
    click.echo("\n".join(paths))


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, metavar="[CONFIG] [key.sub=value ...]")
@click.option("--gpus", type=int, default=None, help="Ranks N of the job to emulate (default: the config's layout).")
@click.option("--nodes", type=int, default=None, help="Nodes the N ranks are spread over (the planner's step).")
@click.option("--ranks", default="first,last", show_default=True, help="first,last | all | R1,R2,...")
@click.option("--steps", type=int, default=3, show_default=True, help="Optimizer steps per rank (the first warms up).")
@click.option("--hardware", default="cpu", show_default=True, help="The planner's hardware for the predicted compute.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per rank, as a list.")
def emulate(args, gpus, nodes, ranks, steps, hardware, as_json):
    """Build and step single ranks of an N-rank job in one process each, on this device, against the
    planner and the memory model (torch's fake process group: no other rank, no network; docs/planner.md).

    \b
      gridshard emulate configs/tiny.yaml --gpus 4 --ranks all parallel.data=2 parallel.tensor=2
    """
    import json

    from ..config import load_config
    from ..planner.emulate import chosen_ranks, emulate as run_emulate, format_reports

    with _refused_as("gridshard emulate: "):
        source, overrides = _split_args(args)
        cfg = load_config(source, overrides)
        world = gpus or cfg.world_size
        reports = run_emulate(cfg, world, chosen_ranks(ranks, world), steps, hardware, nodes or 1)
    click.echo(json.dumps(reports, indent=1) if as_json else format_reports(reports))


@click.command()
@click.argument("run_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@click.option("--hardware", default=None, help="The planner's hardware for the predicted step (default: cpu).")
def diagnose(run_dir, as_json, hardware):
    """Where RUN_DIR's step time and memory went, per rank, against the planner, with fixes (docs/diagnosis.md)."""
    import json

    from ..diagnose import diagnose as run_diagnose, format_report

    with _refused_as("gridshard diagnose: "):
        report = run_diagnose(run_dir, hardware)
    click.echo(json.dumps(report, indent=1) if as_json else format_report(report))


@click.command()
@click.argument("path", metavar="RUN_DIR|CKPT_DIR", type=click.Path(file_okay=False))
@click.option("--prompt", required=True, help="Text to continue (encoded with the run's tokenizer).")
@click.option("--max-new-tokens", type=int, default=200, show_default=True)
@click.option("--temperature", type=float, default=0.8, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=50, show_default=True, help="Sample among the k most likely ids.")
@click.option("--seed", type=int, default=0, show_default=True)
def generate(path, prompt, max_new_tokens, temperature, top_k, seed):
    """Sample a continuation of --prompt from the model in RUN_DIR (its latest checkpoint) or in
    CKPT_DIR, in one process whatever layout trained it; prints the prompt and its continuation."""
    from ..generate import generate_text

    with _refused_as():                          # a CheckpointError is a ConfigError
        prompt, text, folder, step = generate_text(path, prompt, max_new_tokens, temperature, top_k, seed)
    click.echo(f"# {folder} (step {step}), temperature {temperature}, top-k {top_k}, seed {seed}", err=True)
    click.echo(prompt + text)


@click.command()
@click.argument("path", metavar="RUN_DIR|CKPT_DIR", type=click.Path(file_okay=False))
@click.argument("images", nargs=-1, required=True, metavar="IMAGE...", type=click.Path(dir_okay=False))
@click.option("--top", type=int, default=3, show_default=True, help="Classes printed per image.")
def predict(path, images, top):
    """Print the top classes of each IMAGE by the ViT (model.kind: vit) in RUN_DIR (its latest
    checkpoint) or CKPT_DIR, in one process whatever layout trained it (docs/vision.md)."""
    from ..predict import predict_images

    with _refused_as():                          # a CheckpointError is a ConfigError
        folder, step, rows = predict_images(path, list(images), top)
    click.echo(f"# {folder} (step {step})", err=True)
    for image, best in rows:
        click.echo(f"{image}: " + ", ".join(f"{name} {p:.3f}" for name, p in best))


@click.command("prepare-data")
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for tokens.bin, meta.json, "
              "doc_starts.npy and tokenizer.json.")
@click.option("--train-tokenizer", is_flag=True, help="Train a byte-level BPE on the input (needs --vocab-size).")
@click.option("--vocab-size", type=int, default=None, help="Vocabulary of the trained BPE, e.g. 4096.")
@click.option("--tokenizer", "tokenizer_file", type=click.Path(dir_okay=False), default=None,
              help="Use an existing Hugging Face tokenizer.json.")
@click.option("--bytes", "use_bytes", is_flag=True, help="The built-in byte tokenizer (vocabulary 256; the default).")
@click.option("--val-fraction", type=float, default=0.01, show_default=True,
              help="Share of the tokens (the end of the stream) held out for validation.")
@click.option("--workers", type=int, default=None, help="Encoding processes (default: all CPU cores).")
@click.option("--tokenizer-bytes", type=int, default=256 << 20, show_default=True,
              help="Train the BPE on the first this-many bytes of the input.")
@click.option("--overwrite", is_flag=True, help="Replace the preparation in a non-empty --out (its meta.json, "
              "tokens.bin, doc_starts.npy and tokenizer.json; other files stay). Without it a non-empty --out is "
              "refused.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def prepare_data(inputs, out, train_tokenizer, vocab_size, tokenizer_file, use_bytes, val_fraction, workers,
                 tokenizer_bytes, overwrite, no_progress):
    """Tokenise text files or folders INPUT... into OUT: a memory-mapped uint16/uint32 token file
    and its metadata (tokenizer, vocabulary, document starts, train/validation split), streaming
    with constant memory, parallel over CPU cores. Then train on it with
    `gridshard train data.kind=prepared data.path=OUT` (the vocabulary size comes from OUT)."""
    from ..data.prepare import prepare_data as run

    with _refused_as():
        chosen = [name for name, on in (("--train-tokenizer", train_tokenizer), ("--tokenizer", tokenizer_file),
                                        ("--bytes", use_bytes)) if on]
        if len(chosen) > 1:
            raise ConfigError(f"{' and '.join(chosen)} were both given: they choose the tokenizer. Fix: pass one.")
        if vocab_size is not None and not train_tokenizer:
            raise ConfigError("--vocab-size is only used with --train-tokenizer. Fix: add --train-tokenizer, or "
                              "drop --vocab-size (an existing tokenizer has its own vocabulary).")
        if workers is not None and workers < 1:
            raise ConfigError(f"--workers={workers} is invalid: at least one process encodes. Fix: --workers 1 "
                              f"or more.")
        kind = "train" if train_tokenizer else tokenizer_file or "bytes"
        meta = run(inputs, out, kind, vocab_size, val_fraction, workers, tokenizer_bytes=tokenizer_bytes,
                   progress=not no_progress, overwrite=overwrite)
    mb = meta["input_bytes"] / 1e6
    rss = meta["peak_rss_bytes"]
    (a, b), (c, d) = meta["split"]["train"], meta["split"]["val"]
    click.echo(f"prepared {meta['n_tokens']} tokens ({meta['documents']} documents, vocabulary {meta['vocab_size']}, "
               f"{meta['token_dtype']}) from {mb:.1f} MB in {meta['seconds']:.1f} s "
               f"({mb / max(meta['seconds'], 1e-9):.1f} MB/s, {meta['workers']} workers; peak memory "
               f"{rss['main'] / 2**20:.0f} MiB main, {rss['largest_worker'] / 2**20:.0f} MiB largest worker)\n"
               f"train tokens [{a}, {b}), validation tokens [{c}, {d}) -> {out}\n"
               f"train on it: gridshard train data.kind=prepared data.path={out}")
