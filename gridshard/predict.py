"""``gridshard predict RUN_DIR|CKPT_DIR IMAGE...``: a trained ViT's top classes for image files, in
one process whatever layout trained it.

The checkpoint is verified before a tensor is read (:func:`gridshard.checkpoint.reader.open_checkpoint`,
as ``gridshard generate``), loaded into the plain :class:`gridshard.models.vit.VisionTransformer`, and
each image is read as training reads an image folder (:func:`gridshard.data.images.read_image`: grey or
RGB by ``model.channels``, resized to ``model.image_size``, x/255·2 − 1). Class names: the run's image
folder's subfolder names when ``data.kind: images`` and the folder is still there, else the indices
(the digits' indices are the digits).
"""
from __future__ import annotations

import os

import torch

from .errors import ConfigError


def load_vit(folder: str) -> tuple:
    """(plain VisionTransformer with the checkpoint's weights, the run's config dict, its step)."""
    from .checkpoint.reader import open_checkpoint, read_tensors
    from .models.vit import VisionTransformer, saved_model_config

    checked = open_checkpoint(folder)
    config = checked.meta["config"]
    if config["model"].get("kind") != "vit":
        raise ConfigError(f"checkpoint {folder!r} holds a language model: `gridshard predict` classifies images with "
                          f"a ViT (model.kind: vit). Fix: use `gridshard generate` for it.")
    model = VisionTransformer(saved_model_config(config["model"]))
    model.load_state_dict(read_tensors(checked), strict=True)
    return model.eval(), config, checked.step


def class_names(config: dict, num_classes: int) -> list:
    data = config.get("data", {})
    if data.get("kind") == "images" and data.get("path") and os.path.isdir(data["path"]):
        from .data.images import image_classes

        names = image_classes(data["path"])
        if len(names) <= num_classes:
            return names + [str(k) for k in range(len(names), num_classes)]
    return [str(k) for k in range(num_classes)]


def predict_images(path: str, images: list, top: int = 3) -> tuple:
    """(checkpoint folder, step, [(image, [(class name, probability)] × top)]) for a run directory
    or checkpoint ``path`` and image files ``images``."""
    from .checkpoint import resolve_checkpoint
    from .data.images import read_image

    if top < 1:
        raise ConfigError(f"--top={top} is invalid: at least the best class is printed. Fix: use e.g. 3.")
    folder = resolve_checkpoint(path, None)
    model, config, step = load_vit(folder)
    cfg = model.cfg
    batch = torch.stack([read_image(f, cfg.image_size, cfg.channels) for f in images])
    with torch.no_grad():
        probs = torch.softmax(model(batch).double(), -1)
    names = class_names(config, cfg.num_classes)
    p, idx = probs.topk(min(top, cfg.num_classes), -1)
    rows = [(f, [(names[int(i)], float(q)) for q, i in zip(pr, ix)]) for f, pr, ix in zip(images, p, idx)]
    return folder, step, rows
