"""Regression data: bundled UCI sets, any ``.csv``/``.csv.gz`` file, and the synthetic 3-D cube.

File format (as in ``gpnys/data/<name>/``): ``data.csv.gz`` holds comma-separated floats, one row per
observation, the LAST column being the target; an optional ``test_mask.csv.gz`` beside it holds
``n x 10`` zeros/ones, column ``j`` marking the test rows of split ``j``. Files without a mask get ten
seeded random 90/10 splits.

Inputs and targets are standardised on the training rows (as GP papers do); the returned
:class:`Standardizer` maps predictions back to the original units.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpnys.checks import validate_count, validate_seed

__all__ = ["Dataset", "Standardizer", "available", "load", "load_array", "synthetic3d", "NUM_SPLITS"]

DATA_DIR = Path(__file__).resolve().parent / "data"
NUM_SPLITS = 10
SYNTHETIC = ("synthetic3d",)


@dataclass
class Standardizer:
    """Affine maps fitted on the training rows: ``x' = (x - x_mean) / x_std``, ``y' = (y - y_mean) / y_std``.

    Shapes: ``x_mean, x_std: (d,)``; ``y_mean, y_std``: 0-dim tensors.
    """

    x_mean: torch.Tensor
    x_std: torch.Tensor
    y_mean: torch.Tensor
    y_std: torch.Tensor

    @classmethod
    def fit(cls, x: torch.Tensor, y: torch.Tensor) -> "Standardizer":
        # One row has no spread (torch's std would warn and return NaN): unit scale, as for a constant column.
        x_std = x.std(dim=0) if x.shape[0] > 1 else torch.ones_like(x[0])
        y_std = y.std() if y.shape[0] > 1 else torch.ones_like(y[0])
        # Constant columns carry no information; leave them unscaled instead of dividing by zero.
        x_std = torch.where(x_std > 0, x_std, torch.ones_like(x_std))
        y_std = torch.where(y_std > 0, y_std, torch.ones_like(y_std))
        return cls(x.mean(dim=0), x_std, y.mean(), y_std)

    @classmethod
    def identity(cls, x: torch.Tensor, y: torch.Tensor) -> "Standardizer":
        d = x.shape[-1]
        return cls(x.new_zeros(d), x.new_ones(d), y.new_zeros(()), y.new_ones(()))

    def transform_x(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.x_mean) / self.x_std

    def transform_y(self, y: torch.Tensor) -> torch.Tensor:
        return (y - self.y_mean) / self.y_std

    def inverse_y(self, y: torch.Tensor) -> torch.Tensor:
        """Map standardised targets or predictive means back to original units."""
        return y * self.y_std + self.y_mean

    def inverse_variance(self, var: torch.Tensor) -> torch.Tensor:
        """Map a standardised predictive variance back to original units (squared)."""
        return var * self.y_std**2


@dataclass
class Dataset:
    """A train/test split, standardised on the training rows.

    Shapes: ``train_x: (n, d)``, ``train_y: (n,)``, ``test_x: (n_test, d)``, ``test_y: (n_test,)``.
    """

    name: str
    split: int
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    transform: Standardizer
    subsampled: bool = False

    @property
    def n(self) -> int:
        return self.train_x.shape[0]

    @property
    def d(self) -> int:
        return self.train_x.shape[1]

    def describe(self) -> str:
        sub = " (seeded subsample)" if self.subsampled else ""
        return (
            f"{self.name} split {self.split}: n_train={self.n}{sub}, n_test={self.test_x.shape[0]}, d={self.d}"
        )


def available() -> list[str]:
    """Names of the bundled data sets plus the synthetic generators.

    Example:
        >>> from gpnys.datasets import available
        >>> "elevators" in available(), available()[-1]
        (True, 'synthetic3d')
    """
    bundled = sorted(p.name for p in DATA_DIR.iterdir() if (p / "data.csv.gz").exists())
    return bundled + list(SYNTHETIC)


def _read_csv(path: Path) -> np.ndarray:
    # np.loadtxt reads .gz transparently.
    try:
        with warnings.catch_warnings():  # an empty file: the caller's "no rows" error says it, once
            warnings.filterwarnings("ignore", message=".*input contained no data", category=UserWarning)
            arr = np.loadtxt(path, delimiter=",", ndmin=2, dtype=np.float64)
    except ValueError as exc:  # unparsable cells
        raise ValueError(f"data file {path}: could not parse as comma-separated floats ({exc})") from exc
    return arr


def _resolve(name_or_path: str | Path) -> tuple[Path, Path | None, str]:
    """Return (data file, mask file or None, display name)."""
    s = str(name_or_path)
    bundled = DATA_DIR / s / "data.csv.gz"
    if bundled.exists():
        mask = DATA_DIR / s / "test_mask.csv.gz"
        return bundled, mask if mask.exists() else None, s
    path = Path(s)
    if path.is_dir():
        path = path / "data.csv.gz"
    if not path.exists():
        raise ValueError(
            f"data: {s!r} is neither a bundled data set ({', '.join(available())}) nor an existing file"
        )
    mask = None
    for cand in ("test_mask.csv.gz", "test_mask.csv"):
        if (path.parent / cand).exists():
            mask = path.parent / cand
            break
    return path, mask, path.parent.name if path.name.startswith("data.") else path.stem


def load_array(name_or_path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Read a data set as ``(data (N, d+1), test_mask (N, 10) bool)`` after validation.

    Without a mask file the ten splits are seeded random 90/10 splits.
    """
    path, mask_path, _ = _resolve(name_or_path)
    data = _read_csv(path)
    if data.shape[0] == 0:
        raise ValueError(f"data file {path}: no rows")
    if data.shape[1] < 2:
        raise ValueError(f"data file {path}: needs at least 2 columns (inputs and a target), found {data.shape[1]}")
    if not np.isfinite(data).all():
        bad = np.argwhere(~np.isfinite(data))[0]
        raise ValueError(f"data file {path}: NaN/inf at row {bad[0]}, column {bad[1]}")
    if mask_path is not None:
        mask = _read_csv(mask_path)
        if mask.shape[0] != data.shape[0]:
            raise ValueError(
                f"test mask {mask_path}: {mask.shape[0]} rows but the data has {data.shape[0]} rows"
            )
        mask = mask.astype(bool)
    else:
        rng = np.random.default_rng(12345)
        n_test = max(1, data.shape[0] // 10)
        mask = np.zeros((data.shape[0], NUM_SPLITS), dtype=bool)
        for j in range(NUM_SPLITS):
            mask[rng.permutation(data.shape[0])[:n_test], j] = True
    return data, mask


def synthetic3d(n: int, seed: int = 0, noise: float = 0.1) -> np.ndarray:
    """Uniform points in a 3-D cube of edge ``n^(1/3)`` (unit density, AFN paper Sec. 5) with a smooth target.

    Returns ``(n, 4)``: three inputs and ``y = sin(x1/4) + cos(x2/5) + sin((x1 + x3)/7) + noise * eps``.
    """
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, n ** (1.0 / 3.0), size=(n, 3))
    y = np.sin(x[:, 0] / 4) + np.cos(x[:, 1] / 5) + np.sin((x[:, 0] + x[:, 2]) / 7)
    y = y + noise * rng.standard_normal(n)
    return np.concatenate([x, y[:, None]], axis=1)


def _check_int(value: int | None, name: str, low: int) -> None:
    if value is not None:
        validate_count(value, name, low)


def load(
    name_or_path: str | Path,
    split: int = 0,
    n: int | None = None,
    seed: int = 0,
    standardize: bool = True,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
    n_test: int | None = None,
) -> Dataset:
    """Load a data set, choose a split, optionally subsample, and standardise.

    Args:
        name_or_path: a bundled name (see :func:`available`), ``"synthetic3d"``, or a ``.csv``/``.csv.gz``
            path (last column = target).
        split: which of the 10 train/test splits (0-9).
        n: keep a seeded random subset of ``n`` training rows (``None`` = all). For ``synthetic3d`` it is
            the number of training points generated (required).
        seed: seed for the subsample (and the synthetic generator).
        standardize: standardise inputs and targets on the (subsampled) training rows.
        n_test: optionally keep a seeded subset of ``n_test`` test rows.

    Returns:
        A :class:`Dataset` with tensors of ``dtype`` on ``device``.

    Example:
        >>> import torch
        >>> from gpnys.datasets import load
        >>> ds = load("synthetic3d", n=200, seed=0)
        >>> ds.describe()
        'synthetic3d split 0: n_train=200, n_test=23, d=3'
        >>> ds.train_x.dtype, bool(ds.train_x.mean(0).abs().max() < 1e-12)  # standardised on the training rows
        (torch.float64, True)
        >>> torch.allclose(ds.train_x.std(0), torch.ones(3, dtype=torch.float64))
        True
        >>> load("concrete", split=3, n=300).describe()  # a bundled set: its split 3, 300 training rows
        'concrete split 3: n_train=300 (seeded subsample), n_test=103, d=8'
    """
    split = validate_count(split, "split", 0, NUM_SPLITS - 1, "the last split")
    _check_int(n, "n", 1)
    _check_int(n_test, "n_test", 1)
    seed = validate_seed(seed)
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    name = str(name_or_path)
    subsampled = False
    if name in SYNTHETIC:
        if n is None:
            raise ValueError("n is required for the synthetic3d data set")
        total = int(math.ceil(n / 0.9))
        try:
            data = synthetic3d(total, seed=seed)
        except (ValueError, MemoryError) as err:  # numpy's "Maximum allowed dimension exceeded", or no memory
            raise ValueError(f"n={n} is too large to generate: {err}") from None
        rng = np.random.default_rng(seed + 1000 * split)
        test = np.zeros(total, dtype=bool)
        test[rng.permutation(total)[: total - n]] = True
        train_rows, test_rows = np.flatnonzero(~test), np.flatnonzero(test)
    else:
        data, mask = load_array(name_or_path)
        _, _, name = _resolve(name_or_path)
        test = mask[:, split]
        train_rows, test_rows = np.flatnonzero(~test), np.flatnonzero(test)
        if train_rows.size == 0 or test_rows.size == 0:
            raise ValueError(f"split {split} of {name!r} has an empty train or test part")
        rng = np.random.default_rng(seed)
        if n is not None:
            if n > train_rows.size:
                raise ValueError(f"n={n} is larger than the {train_rows.size} training rows of {name!r} split {split}")
            if n < train_rows.size:
                train_rows = np.sort(rng.choice(train_rows, size=n, replace=False))
                subsampled = True
    if n_test is not None and n_test < test_rows.size:
        test_rows = np.sort(np.random.default_rng(seed + 1).choice(test_rows, size=n_test, replace=False))
    t = torch.as_tensor(data, dtype=dtype, device=device)
    tr, te = t[torch.as_tensor(train_rows, device=t.device)], t[torch.as_tensor(test_rows, device=t.device)]
    train_x, train_y, test_x, test_y = tr[:, :-1], tr[:, -1], te[:, :-1], te[:, -1]
    tf = Standardizer.fit(train_x, train_y) if standardize else Standardizer.identity(train_x, train_y)
    return Dataset(
        name=name,
        split=split,
        train_x=tf.transform_x(train_x).contiguous(),
        train_y=tf.transform_y(train_y).contiguous(),
        test_x=tf.transform_x(test_x).contiguous(),
        test_y=tf.transform_y(test_y).contiguous(),
        transform=tf,
        subsampled=subsampled,
    )
