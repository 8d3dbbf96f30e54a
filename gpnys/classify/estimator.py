"""scikit-learn's estimator protocol for the Laplace models (:mod:`gpnys.classify.laplace`,
:mod:`gpnys.classify.reduced`): parameters (``get_params`` / ``set_params``, so that ``sklearn.base.clone``,
``Pipeline`` and ``GridSearchCV`` take them), tags, array input and output, and ``NotFittedError``.

Written here rather than inherited from ``sklearn.base.BaseEstimator``: importing scikit-learn takes about 1.3 s,
and ``gpnys classify`` (like every other command line) imports :mod:`gpnys.classify` at its start. scikit-learn is
imported only where it is used: for array (not tensor) input, ``score``, the tags and the ``NotFittedError``.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from typing import Any

import gpytorch
import numpy as np
import torch

from gpnys.checks import validate_array, validate_points

__all__ = ["LaplaceEstimator", "as_output"]


def _short(value: Any) -> str:
    """A one-line repr: a module as its class and its kernels' (``ScaleKernel(MaternKernel())``), a tensor as its
    shape."""
    if isinstance(value, torch.nn.Module):
        children = [_short(child) for child in value.children() if isinstance(child, gpytorch.kernels.Kernel)]
        return type(value).__name__ + (f"({', '.join(children)})" if children else "()")
    if isinstance(value, torch.Tensor):
        return f"tensor(shape={tuple(value.shape)})"
    return repr(value)


class LaplaceEstimator:
    """The estimator protocol of ``sklearn.base.BaseEstimator`` for a class whose ``__init__`` stores its arguments
    unchanged under their names (and validates nothing: :meth:`fit` does), plus the conversions between tensors
    and arrays. ``_estimator_type``: ``"classifier"`` or ``None``."""

    _estimator_type: str | None = None

    # ---- parameters (BaseEstimator's get_params / set_params) ---------------------------------------------
    @classmethod
    def _get_param_names(cls) -> list[str]:
        names = []
        for p in inspect.signature(cls.__init__).parameters.values():
            if p.name == "self":
                continue
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                raise RuntimeError(f"{cls.__name__}.__init__ takes *args or **kwargs: its parameters are unknown")
            names.append(p.name)
        return sorted(names)

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The constructor's arguments by name (with ``deep``, those of nested estimators as ``name__key``)."""
        out: dict[str, Any] = {}
        for name in self._get_param_names():
            value = getattr(self, name)
            if deep and hasattr(value, "get_params") and not isinstance(value, type):
                out.update((f"{name}__{key}", v) for key, v in value.get_params().items())
            out[name] = value
        return out

    def set_params(self, **params: Any) -> "LaplaceEstimator":
        """Set constructor arguments (``name`` or ``name__key`` of a nested estimator); returns ``self``. They are
        validated by :meth:`fit`."""
        if not params:
            return self
        valid = self.get_params(deep=True)
        nested: dict[str, dict[str, Any]] = defaultdict(dict)
        for key, value in params.items():
            name, sub, rest = key.partition("__")
            if name not in valid:
                raise ValueError(f"Invalid parameter {name!r} for estimator {type(self).__name__}. Valid parameters "
                                 f"are: {self._get_param_names()!r}.")
            if sub:
                nested[name][rest] = value
            else:
                setattr(self, name, value)
                valid[name] = value
        for name, sub_params in nested.items():
            valid[name].set_params(**sub_params)
        return self

    def __repr__(self) -> str:
        """The class and the arguments that differ from their defaults (all required ones)."""
        defaults = {p.name: p.default for p in inspect.signature(type(self).__init__).parameters.values()}
        shown = []
        for name in self._get_param_names():
            value, default = getattr(self, name, None), defaults.get(name)
            same = default is not inspect.Parameter.empty and not isinstance(value, torch.Tensor) and (
                value is default or (type(value) is type(default) and value == default))
            if not same:
                shown.append(f"{name}={_short(value)}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def __sklearn_tags__(self) -> Any:
        """scikit-learn's tags (1.6 on): a classifier (two classes, ``multi_class=False``) or a plain estimator;
        ``y`` is required."""
        from sklearn.utils import ClassifierTags, Tags, TargetTags

        tags = Tags(estimator_type=self._estimator_type, target_tags=TargetTags(required=True),
                    transformer_tags=None, regressor_tags=None, classifier_tags=None)
        if self._estimator_type == "classifier":
            tags.classifier_tags = ClassifierTags(multi_class=False)
        return tags

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "f_hat_")

    def _check_fitted(self) -> None:
        if not self.__sklearn_is_fitted__():
            from sklearn.exceptions import NotFittedError

            raise NotFittedError(f"This {type(self).__name__} instance is not fitted yet. Call 'fit' with "
                                 "appropriate arguments before using this estimator.")

    # ---- tensors and arrays ----------------------------------------------------------------------------------
    def _fit_points(self, X: Any, device: torch.device) -> torch.Tensor:
        """Training points ``X`` ``(n, d)`` as a floating tensor; sets ``n_features_in_``. A tensor is checked by
        :func:`~gpnys.checks.validate_points` and kept; anything else goes through scikit-learn's ``validate_data``
        (float64, or float32 if given) and onto ``device``."""
        if isinstance(X, torch.Tensor):
            validate_points(X, "X")
            self.n_features_in_ = X.shape[1]
            if hasattr(self, "feature_names_in_"):  # from an earlier fit on a data frame
                del self.feature_names_in_
            return X
        arr = validate_array(self, X, reset=True, dtype=[np.float64, np.float32])
        # a read-only array (a memory map, a data frame's values) is copied: torch shares no read-only memory
        return torch.from_numpy(np.require(arr, requirements="W")).to(device)

    def _query_points(self, X: Any, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bool]:
        """Query points ``X`` ``(m, d)`` (``m = 0`` allowed) in ``dtype`` on ``device``, and whether ``X`` was a
        tensor (the predictions are then tensors, else numpy arrays)."""
        self._check_fitted()
        if isinstance(X, torch.Tensor):
            if not (X.dim() == 2 and X.shape[0] == 0 and X.shape[1] > 0 and X.is_floating_point()):
                validate_points(X, "X")
            if X.shape[1] != self.n_features_in_:
                raise ValueError(f"X must have {self.n_features_in_} columns, got {X.shape[1]}")
            return X.to(device=device, dtype=dtype), True
        arr = validate_array(self, X, reset=False, dtype=[np.float64, np.float32], ensure_min_samples=0)
        return torch.from_numpy(np.require(arr, requirements="W")).to(device=device, dtype=dtype), False


def as_output(value: torch.Tensor, tensor: bool) -> Any:
    """``value`` for a tensor query, else as a numpy array."""
    return value if tensor else value.numpy(force=True)
