"""Labelled images for the Vision Transformer: scikit-learn's bundled handwritten digits
(``data.kind: digits``, no download) and a class-per-subfolder image folder (``data.kind:
images``, read with Pillow), as layout-independent global batches.

Digits: the 1797 8×8 grey images of ``sklearn.datasets.load_digits`` (values 0..16, ten
classes), upscaled to ``model.image_size`` (bilinear) and normalised to x/16·2 − 1 ∈ [−1, 1].
Image folder: ``data.path/<class>/<file>``, classes in sorted order (label = index), files in
sorted order, each converted to grey (``channels: 1``) or RGB (3), resized to image_size
(bilinear) and normalised to x/255·2 − 1. Either way the whole set is held as one float tensor
[n, C, H, W] (small sets: the digits are 1.8 MB at 16×16).

Split: a fixed permutation (numpy PCG64 seeded 0, independent of ``train.seed``) puts the last
⌈val_fraction·n⌉ of it (default 0.2) in validation, the rest in training — the same split at
every layout and every run.

Batches (:class:`ImagePlan`): training step k's global batch is the samples at positions
k·G … k·G + G − 1 of an endless stream of epochs, epoch e a permutation of the training set
drawn by PCG64 seeded (seed, e); validation batch j is positions j·G … of the validation set in
its order, wrapping around. Data rank d of D takes rows [d·G/D, (d+1)·G/D) of the global batch
as A micro-batches of m (as :class:`gridshard.data.BatchPlan`), and N = G: one label per image.
"""
from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import ConfigError
from .batches import rank_rows

DEFAULT_VAL_FRACTION = 0.2
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


def load_digits_tensor(image_size: int) -> tuple:
    """(images [1797, 1, S, S] float32 in [−1, 1], labels [1797] int64) (module docstring)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("data.kind=digits needs scikit-learn (its bundled digits). Fix: pip install -e .[vision]"
                          ) from None
    digits = load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1) / 16.0
    if image_size != x.shape[-1]:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return x * 2 - 1, torch.from_numpy(digits.target.astype(np.int64))


def load_image_folder(path: str, image_size: int, channels: int) -> tuple:
    """(images [n, C, S, S] in [−1, 1], labels [n], class names) of a class-per-subfolder folder
    (module docstring); a ConfigError names an unreadable file or an empty class."""
    classes = image_classes(path)
    images, labels = [], []
    for label, name in enumerate(classes):
        for file in image_files(os.path.join(path, name)):
            images.append(read_image(file, image_size, channels))
            labels.append(label)
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64), classes


def read_image(file: str, image_size: int, channels: int) -> torch.Tensor:
    """One image file as the model reads it: [C, S, S] in [−1, 1], grey (C = 1) or RGB (3), resized
    (bilinear) to S = image_size (module docstring); a ConfigError names an unreadable file."""
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError("reading image files needs Pillow. Fix: pip install -e .[vision]") from None
    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise ConfigError(f"model.channels={channels} is invalid for image files: they are read as grey (1) or RGB "
                          f"(3). Fix: set model.channels to 1 or 3.")
    try:
        with Image.open(file) as im:
            im = im.convert(mode).resize((image_size, image_size), Image.BILINEAR)
            pixels = torch.from_numpy(np.asarray(im, dtype=np.float32).copy())
    except (OSError, UnidentifiedImageError) as e:
        raise ConfigError(f"{file!r} is not a readable image ({e}). Fix: remove or replace it.") from None
    x = pixels.reshape(image_size, image_size, channels).permute(2, 0, 1)
    return (x / 255.0 * 2 - 1).contiguous()


def image_classes(path: str) -> list:
    """The class subfolders of ``path`` (sorted, hidden ones skipped), each holding ≥ 1 image file."""
    if not os.path.isdir(path):
        raise ConfigError(f"data.path={path!r} is not a folder. Fix: point it at a folder with one subfolder of "
                          f"images per class.")
    classes = sorted(e for e in os.listdir(path) if not e.startswith(".") and os.path.isdir(os.path.join(path, e)))
    if not classes:
        raise ConfigError(f"data.path={path!r} has no class subfolders. Fix: put each class's images in a "
                          f"subfolder named after the class.")
    for name in classes:
        if not image_files(os.path.join(path, name)):
            raise ConfigError(f"data.path: class folder {name!r} holds no image ({', '.join(IMAGE_SUFFIXES)}). "
                              f"Fix: add images or remove the folder.")
    return classes


def image_files(folder: str) -> list:
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if not f.startswith(".") and f.lower().endswith(IMAGE_SUFFIXES))


def split_indices(n: int, val_fraction: float) -> tuple:
    """(training indices, validation indices): the last ⌈val_fraction·n⌉ of a PCG64(0) permutation."""
    order = np.random.Generator(np.random.PCG64(0)).permutation(n)
    n_val = math.ceil(val_fraction * n)
    return order[:n - n_val], order[n - n_val:]


class ImagePlan:
    """Which images this data rank feeds at each step (module docstring). ``stream`` 0: training
    (shuffled epochs), 1: validation (in order)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, global_batch: int, micro_batch: int,
                 data_size: int, data_rank: int, seed: int, stream: int = 0):
        self.images, self.labels, self.seed, self.stream = images, labels, seed, stream
        self.global_batch, self.micro_batch = global_batch, micro_batch
        self.rows = rank_rows(global_batch, data_size, data_rank)
        self.tokens = images                       # the resident data (what the trainer's memory accounts)

    def global_indices(self, step: int) -> np.ndarray:
        """The G sample indices of global batch ``step``."""
        n, G = len(self.labels), self.global_batch
        positions = np.arange(step * G, (step + 1) * G)
        if self.stream:
            return positions % n
        epochs, within = positions // n, positions % n
        perms = {int(e): np.random.Generator(np.random.PCG64([self.seed, int(e)])).permutation(n)
                 for e in np.unique(epochs)}
        return np.array([perms[int(e)][w] for e, w in zip(epochs, within)])

    def step_batches(self, step: int) -> tuple:
        """(this rank's A micro-batches (images [m, C, H, W], labels [m]) of ``step``, N = G)."""
        idx = torch.from_numpy(self.global_indices(step)[self.rows])
        x, y = self.images[idx], self.labels[idx]
        return list(zip(x.split(self.micro_batch), y.split(self.micro_batch))), self.global_batch


def image_plans(cfg, data_size: int, data_rank: int) -> tuple:
    """(training :class:`ImagePlan`, validation plan or None) of a config with ``data.kind`` digits
    or images (module docstring)."""
    d, t, m = cfg.data, cfg.train, cfg.model.resolve()
    if d.kind == "digits":
        if m.channels != 1:
            raise ConfigError(f"model.channels={m.channels} is invalid for data.kind=digits: the digits are grey. "
                              f"Fix: set model.channels: 1.")
        images, labels = load_digits_tensor(m.image_size)
    else:
        images, labels, _ = load_image_folder(d.path, m.image_size, m.channels)
    if int(labels.max()) >= m.num_classes:
        raise ConfigError(f"model.num_classes={m.num_classes} is too small: the data has {int(labels.max()) + 1} "
                          f"classes. Fix: set model.num_classes: {int(labels.max()) + 1}.")
    fraction = DEFAULT_VAL_FRACTION if d.val_fraction is None else d.val_fraction
    train_idx, val_idx = split_indices(len(labels), fraction)
    idx = torch.from_numpy(train_idx)
    plan = ImagePlan(images[idx], labels[idx], t.global_batch, t.micro_batch, data_size, data_rank, t.seed)
    if not len(val_idx):
        return plan, None
    v = torch.from_numpy(val_idx)
    return plan, ImagePlan(images[v], labels[v], t.global_batch, t.micro_batch, data_size, data_rank, t.seed,
                           stream=1)
