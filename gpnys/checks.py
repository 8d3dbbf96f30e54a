"""Argument checks and gpnys's warning category, shared by every layer (the ground floor).

Each check raises ``ValueError`` naming the argument, in the manner of scikit-learn's ``utils/validation.py``;
:class:`NumericalWarning` marks numerical trouble that gpnys recovered from.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection
from typing import Any

import numpy as np
import torch

__all__ = ["NumericalWarning", "HyperparameterError", "validate_points", "validate_training_data", "validate_positive",
           "validate_mu", "validate_count", "validate_seed", "validate_positive_tensors", "validate_choice",
           "validate_array"]


class NumericalWarning(RuntimeWarning):
    """Numerical trouble that gpnys recovered from (a diagonal shift, a fallback); see ``summary()``."""


class HyperparameterError(ValueError):
    """A hyperparameter at which the marginal likelihood does not exist (a non-finite or non-positive
    length-scale, outputscale or noise), named in the message. An optimiser's trial point can land there (a
    length-scale whose softplus underflowed to 0): ``PreconditionedSingleTaskGP``'s fit reads it as an infinite
    loss, from which L-BFGS-B steps back."""


def validate_points(X: torch.Tensor, name: str = "X") -> None:
    """Raise ``ValueError`` unless ``X`` is a finite, non-empty ``(n, d)`` floating tensor."""
    if not isinstance(X, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor (n, d), got {type(X).__name__}"
                         + (" (torch.as_tensor converts it)" if hasattr(X, "__array__") else ""))
    if X.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor (n, d), got shape {tuple(X.shape)}")
    if X.shape[0] == 0 or X.shape[1] == 0:
        raise ValueError(f"{name} is empty: shape {tuple(X.shape)}")
    if not X.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor, got {X.dtype}")
    if not torch.isfinite(X).all():
        raise ValueError(f"{name} contains NaN or inf")


def validate_test_points(test_x: torch.Tensor, train_x: torch.Tensor, name: str = "test_x") -> torch.Tensor:
    """``test_x`` as ``(..., m, d)`` points for a model on ``train_x`` ``(..., n, d)``: a ``ValueError`` naming it
    unless it is a finite floating tensor of ``train_x``'s ``d`` and device; in ``train_x``'s dtype (float32 points
    for a float64 model are promoted, as GPyTorch does); a 1-D ``test_x`` of a model on one input dimension is ``m``
    points (``(m, 1)``), as in GPyTorch.

    Example:
        >>> import torch
        >>> from gpnys.checks import validate_test_points
        >>> validate_test_points(torch.zeros(5), torch.zeros(10, 1)).shape
        torch.Size([5, 1])
    """
    if not isinstance(test_x, torch.Tensor) or not test_x.is_floating_point():
        raise ValueError(f"{name} must be a floating torch.Tensor (m, d), got "
                         f"{getattr(test_x, 'dtype', type(test_x).__name__)}")
    d = train_x.shape[-1]
    if test_x.dim() == 1 and d == 1:
        test_x = test_x[:, None]
    if test_x.dim() < 2 or test_x.shape[-1] != d:
        raise ValueError(f"{name} must be (m, {d}) like the training inputs, got shape {tuple(test_x.shape)}")
    if test_x.device != train_x.device:
        raise ValueError(f"{name} must be on the training inputs' device {train_x.device}, got {test_x.device}")
    if not bool(torch.isfinite(test_x).all()):
        raise ValueError(f"{name} contains NaN or inf")
    return test_x.to(train_x.dtype)


def validate_training_data(X: torch.Tensor, y: torch.Tensor, names: tuple[str, str] = ("train_x", "train_y")) -> None:
    """Raise ``ValueError`` naming the argument unless ``X`` passes :func:`validate_points` and ``y`` is a finite
    ``(n,)`` tensor with ``X``'s ``n`` and device (checked before any optimiser step touches a parameter; the dtypes
    may differ, as GPyTorch promotes float32 inputs to a float64 model's)."""
    validate_points(X, names[0])
    if not isinstance(y, torch.Tensor) or y.dim() != 1 or y.shape[0] != X.shape[0]:
        raise ValueError(f"{names[1]} must be a 1-D tensor of {X.shape[0]} targets, got {getattr(y, 'shape', type(y))}")
    if not y.is_floating_point():
        raise ValueError(f"{names[1]} must be a floating tensor, got {y.dtype}")
    if y.device != X.device:
        raise ValueError(f"{names[1]} must be on {names[0]}'s device {X.device}, got {y.device}")
    if not torch.isfinite(y).all():
        raise ValueError(f"{names[1]} contains NaN or inf")


def validate_positive(value: float, name: str) -> float:
    """Return ``value`` as a float; raise ``ValueError`` naming ``name`` unless it is positive and finite."""
    try:
        val = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a positive number, got {value!r}") from exc
    if not (val > 0 and math.isfinite(val)):
        raise ValueError(f"{name} must be positive and finite, got {value!r}")
    return val


def validate_positive_tensors(*checks: tuple[str, torch.Tensor, bool], zero: torch.Tensor | None = None) -> bool:
    """Check tensors in one host read: a ``ValueError`` naming the first ``(name, tensor, zero_ok)`` of ``checks``
    with an entry that is non-finite, negative or, unless ``zero_ok``, 0. Returns whether every entry of ``zero``
    is exactly 0 (``False`` without it).

    Example:
        >>> import torch
        >>> from gpnys.checks import validate_positive_tensors
        >>> validate_positive_tensors(("noise", torch.tensor(0.1), False), zero=torch.tensor([0.0]))
        True
        >>> validate_positive_tensors(("noise", torch.tensor(0.0), False))
        Traceback (most recent call last):
        ...
        ValueError: noise must be positive and finite, got [0.0]
    """
    flags = []
    for _, value, zero_ok in checks:
        v = value.detach()
        bad = ~torch.isfinite(v) | (v < 0)
        flags.append((bad if zero_ok else bad | (v == 0)).any())
    if zero is not None:
        flags.append((zero.detach() == 0).all())
    *bad, zeros = torch.stack(flags).tolist() + ([] if zero is not None else [False])
    for (name, value, _), failed in zip(checks, bad):
        if failed:
            raise ValueError(f"{name} must be positive and finite, got {value.detach().reshape(-1)[:4].tolist()}")
    return bool(zeros)


def validate_mu(mu: float) -> float:
    """Return ``mu`` as a float; raise ``ValueError`` unless it is positive and finite."""
    return validate_positive(mu, "mu")


def validate_count(value: int, name: str, low: int = 1, high: int | None = None, high_name: str = "n") -> int:
    """Return ``value`` as an int in ``[low, high]``; raise ``ValueError`` naming ``name`` otherwise."""
    # numbers.Integral takes numpy's integers too (GridSearchCV's grids of np.arange); Real an integral float
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral) and not (
        isinstance(value, numbers.Real) and float(value).is_integer()
    ):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    value = int(value)
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}={value} exceeds {high_name}={high}")
    return value


def validate_seed(seed: Any, name: str = "seed") -> int:
    """Return ``seed`` as an int (numpy's integers too); raise ``ValueError`` naming it (``name``) otherwise."""
    if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {seed!r}")
    return int(seed)


def validate_choice(value: Any, name: str, allowed: Collection[Any], *, also: str = "") -> Any:
    """Return ``value`` if it is one of ``allowed``; raise ``ValueError`` naming ``name`` otherwise.

    ``also`` names what else the caller accepts (``"or None"``, ``"or a GPyTorch kernel"``), for the message only.
    A mapping or set is listed sorted, a sequence in its order.

    Example:
        >>> validate_choice("fps", "landmarks", ("fps", "uniform"))
        'fps'
    """
    try:
        ok = value in allowed
    except (TypeError, ValueError, RuntimeError):  # unhashable, or an array whose comparison has no single truth
        ok = False
    if not ok:
        shown = sorted(allowed) if isinstance(allowed, (set, frozenset, dict)) else allowed
        tail = f" {also}" if also else ""
        raise ValueError(f"{name} must be one of {shown}{tail}, got {value!r}")
    return value


def validate_array(est: Any, X: Any, *, reset: bool, **kwargs: Any) -> np.ndarray:
    """scikit-learn's ``validate_data`` (a function from 1.6 on) on a non-tensor ``X`` for the estimator ``est``
    (``reset`` sets ``n_features_in_``, otherwise ``X`` must have that many columns), its messages prefixed
    ``"X: "``. Before 1.6: ``est._validate_data`` where ``est`` is a ``BaseEstimator``, else ``check_array`` and
    ``n_features_in_`` by hand. scikit-learn is imported here, on first use.

    Example:
        >>> from sklearn.base import BaseEstimator
        >>> from gpnys.checks import validate_array
        >>> est = BaseEstimator()
        >>> validate_array(est, [[1.0, 2.0], [3.0, 4.0]], reset=True).shape, est.n_features_in_
        ((2, 2), 2)
    """
    from sklearn.utils.validation import check_array

    try:
        try:
            from sklearn.utils.validation import validate_data
        except ImportError:  # scikit-learn < 1.6
            if hasattr(est, "_validate_data"):
                return est._validate_data(X, reset=reset, **kwargs)
            arr = check_array(X, **kwargs)
            if reset:
                est.n_features_in_ = arr.shape[1]
            elif arr.shape[1] != est.n_features_in_:
                raise ValueError(f"X has {arr.shape[1]} features, but {type(est).__name__} is expecting "
                                 f"{est.n_features_in_} features as input.") from None
            return arr
        return validate_data(est, X, reset=reset, **kwargs)
    except ValueError as exc:
        raise ValueError(f"X: {exc}") from exc
