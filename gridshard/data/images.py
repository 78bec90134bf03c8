"""Labelled images for the Vision Transformer: scikit-learn's bundled handwritten digits
(``data.kind: digits``, no download) and a class-per-subfolder image folder (``data.kind:
images``, read with Pillow), as layout-independent global batches.

Digits: the 1797 8×8 grey images of ``sklearn.datasets.load_digits`` (values 0..16, ten
classes), upscaled to ``model.image_size`` (bilinear) and normalised to x/16·2 − 1 ∈ [−1, 1].
Image folder: ``data.path/<class>/<file>``, classes in sorted order (label = index), files in
sorted order, each converted to grey (``channels: 1``) or RGB (3), resized to image_size
(bilinear) and normalised to x/255·2 − 1. The digits are held as one float tensor [n, C, H, W]
(1.8 MB at 16×16); an image folder is an index of files (:class:`FolderImages`) and each data rank
reads, at each step, only the files of its own rows. Before launch (config validation,
:func:`verify_image_folder`) every file of the folder is checked: a non-image file or one Pillow
cannot verify is refused by name, as are a missing folder, no class folders and an empty class.

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

from ..errors import ConfigError, need_package
from .batches import rank_rows

DEFAULT_VAL_FRACTION = 0.2
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


#: The digits: 1797 images; what importing scikit-learn's loader adds to a worker's resident set (scikit-learn
#: 1.9.1 under torch 2.13 CPU, Linux: 77.3 MiB of ``Job.data_bytes`` at 16×16, less the image tensors).
DIGITS_COUNT, DIGITS_IMPORT_BYTES = 1797, 74 << 20


def image_data_resident_bytes(cfg) -> int:
    """What loading a config's image data adds to each worker's resident set before training, for the
    pre-launch memory check (``gridshard.planner.fit``; the trainer measures it, ``Job.data_bytes``):
    the digits' import (:data:`DIGITS_IMPORT_BYTES`) and two fp32 copies of the set (the whole, then
    its training and validation shares), 2·1797·C·S²·4; 0 for an image folder (read per step) and
    for token data."""
    if cfg.data.kind != "digits":
        return 0
    m = cfg.model.resolve()
    return DIGITS_IMPORT_BYTES + 2 * DIGITS_COUNT * m.channels * m.image_size ** 2 * 4


def load_digits_tensor(image_size: int) -> tuple:
    """(images [1797, 1, S, S] float32 in [−1, 1], labels [1797] int64) (module docstring)."""
    digits = need_package("sklearn.datasets", "data.kind=digits needs scikit-learn (its bundled digits). Fix: "
                          "pip install -e .[vision]").load_digits()
    x = torch.from_numpy(digits.images.astype(np.float32)).unsqueeze(1) / 16.0
    if image_size != x.shape[-1]:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False)
    return x * 2 - 1, torch.from_numpy(digits.target.astype(np.int64))


def folder_index(path: str) -> tuple:
    """(image files, labels [n], class names) of a class-per-subfolder folder, nothing read:
    classes sorted (label = index), each class's files sorted."""
    classes = image_classes(path)
    files, labels = [], []
    for label, name in enumerate(classes):
        found = image_files(os.path.join(path, name))
        files += found
        labels += [label] * len(found)
    return files, torch.tensor(labels, dtype=torch.int64), classes


class FolderImages:
    """An image folder's files, read when indexed: ``images[idx]`` reads the files ``idx`` names
    and returns them stacked [len(idx), C, S, S] (:func:`read_image`). An :class:`ImagePlan` over
    it reads, at each step, only this data rank's G/D rows of the global batch — no rank holds
    the set, nor reads another rank's images (each file is decoded again in each epoch that
    draws it: cheap for small images, and nothing accumulates in memory)."""

    def __init__(self, files: list, image_size: int, channels: int):
        self.files, self.image_size, self.channels = list(files), image_size, channels
        self.reads = 0                              # files decoded so far (what the tests count)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, idx: torch.Tensor) -> torch.Tensor:
        chosen = [self.files[int(i)] for i in idx]
        self.reads += len(chosen)
        return torch.stack([read_image(f, self.image_size, self.channels) for f in chosen])

    def subset(self, idx) -> "FolderImages":
        return FolderImages([self.files[int(i)] for i in idx], self.image_size, self.channels)


def verify_image_folder(path: str) -> int:
    """Before launch: ``path`` is a folder of non-empty class folders (:func:`image_classes`), no
    class folder holds a file that is not an image (a suffix outside ``IMAGE_SUFFIXES``: named, as a
    corrupt file is), and every image file opens with Pillow and passes ``Image.verify()`` (its
    header and, for PNG, its chunk checksums; nothing is decoded). One ConfigError names the first
    problem. Returns the number of images."""
    Image = _pillow()
    n = 0
    for name in image_classes(path):
        folder = os.path.join(path, name)
        others = sorted(f for f in os.listdir(folder) if not f.startswith(".") and not f.lower().endswith(
            IMAGE_SUFFIXES) and os.path.isfile(os.path.join(folder, f)))
        if others:
            raise ConfigError(f"data.path: {os.path.join(folder, others[0])!r} is not an image file (suffix not in "
                              f"{', '.join(IMAGE_SUFFIXES)}). Fix: remove it from the class folder, or convert it.")
        for file in image_files(folder):
            try:
                with Image.open(file) as im:
                    im.verify()
            except Exception as e:                  # Pillow raises many types for a damaged file
                raise ConfigError(f"{file!r} is not a readable image ({type(e).__name__}: {e}). Fix: remove or "
                                  f"replace it.") from None
            n += 1
    return n


def _pillow():
    return need_package("PIL.Image", "reading image files needs Pillow. Fix: pip install -e .[vision]")


def read_image(file: str, image_size: int, channels: int) -> torch.Tensor:
    """One image file as the model reads it: [C, S, S] in [−1, 1], grey (C = 1) or RGB (3), resized
    (bilinear) to S = image_size (module docstring); a ConfigError names an unreadable file."""
    Image = _pillow()
    mode = {1: "L", 3: "RGB"}.get(channels)
    if mode is None:
        raise ConfigError(f"model.channels={channels} is invalid for image files: they are read as grey (1) or RGB "
                          f"(3). Fix: set model.channels to 1 or 3.")
    try:
        with Image.open(file) as im:
            im = im.convert(mode).resize((image_size, image_size), Image.BILINEAR)
            pixels = torch.from_numpy(np.asarray(im, dtype=np.float32).copy())
    except (OSError, Image.UnidentifiedImageError) as e:
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
        # the resident data (what the trainer's memory accounts): a tensor, or a FolderImages (no bytes held)
        self.tokens = images

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
    else:                                          # read per rank and step (FolderImages)
        files, labels, _ = folder_index(d.path)
        images = FolderImages(files, m.image_size, m.channels)
    if int(labels.max()) >= m.num_classes:
        raise ConfigError(f"model.num_classes={m.num_classes} is too small: the data has {int(labels.max()) + 1} "
                          f"classes. Fix: set model.num_classes: {int(labels.max()) + 1}.")
    fraction = DEFAULT_VAL_FRACTION if d.val_fraction is None else d.val_fraction
    train_idx, val_idx = split_indices(len(labels), fraction)
    def take(i):                                   # a share of the set: files stay unread
        return images.subset(i) if isinstance(images, FolderImages) else images[i]

    idx = torch.from_numpy(train_idx)
    plan = ImagePlan(take(idx), labels[idx], t.global_batch, t.micro_batch, data_size, data_rank, t.seed)
    if not len(val_idx):
        return plan, None
    v = torch.from_numpy(val_idx)
    return plan, ImagePlan(take(v), labels[v], t.global_batch, t.micro_batch, data_size, data_rank, t.seed,
                           stream=1)
