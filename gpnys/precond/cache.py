"""Reuse of everything that depends only on the points ``X`` across hyperparameter steps (digest §8).

FPS order, uniform landmark draws and causal kNN patterns do not depend on the noise, the outputscale or
(for isotropic kernels) the length-scale, so a GP optimiser rebuilding AFN/FSAI every step can share one
:class:`PointCache`. For ARD kernels the neighbour order depends on the length-scale vector, so patterns
are recomputed on ``X / lengthscale`` and cached under that exact vector.
"""

from __future__ import annotations

from typing import Any, Hashable

import gpytorch
import torch

from gpnys import landmarks
from gpnys.precond.knn import causal_knn

__all__ = ["PointCache", "metric_scale"]


def metric_scale(kernel: gpytorch.kernels.Kernel) -> torch.Tensor | None:
    """The ARD length-scale vector ``(d,)`` of a (unit-variance) stationary kernel, or ``None`` if isotropic.

    An isotropic length-scale only rescales all distances, so it leaves every neighbour order unchanged.
    """
    ls = getattr(kernel, "lengthscale", None) if getattr(kernel, "has_lengthscale", False) else None
    if ls is None or ls.numel() <= 1:
        return None
    return ls.detach().reshape(-1)


class PointCache:
    """Caches landmarks and kNN patterns of fixed points ``X (n, d)``; ``hits``/``misses`` count reuse.

    * :meth:`fps` — FPS order computed once for the largest ``k`` asked; smaller ``k`` reuse the prefix
      (the FPS order of the first ``k`` points is a prefix of the longer order).
    * :meth:`uniform` — uniform landmark draws keyed by ``(k, seed)``.
    * :meth:`knn` — causal kNN patterns keyed by ``(ordering key, w, input scaling)``.
    """

    def __init__(self, X: torch.Tensor) -> None:
        self.X = X
        self.hits = 0
        self.misses = 0
        self._fps: torch.Tensor | None = None
        self._store: dict[Hashable, Any] = {}

    def check(self, X: torch.Tensor) -> None:
        """Raise ``ValueError`` unless ``X`` holds the points this cache was built for."""
        if X is self.X:
            return
        if X.shape != self.X.shape or X.device != self.X.device or not torch.equal(X, self.X.to(X.dtype)):
            raise ValueError("cache was built for different points X")

    def _get(self, key: Hashable, make: Any) -> Any:
        if key in self._store:
            self.hits += 1
        else:
            self.misses += 1
            self._store[key] = make()
        return self._store[key]

    def fps(self, k: int) -> torch.Tensor:
        """The first ``k`` FPS landmarks of ``X`` in selection order. ``(k,)`` long."""
        if self._fps is not None and self._fps.numel() >= k:
            self.hits += 1
        else:
            self.misses += 1
            self._fps = landmarks.fps(self.X, k).indices
        return self._fps[:k]

    def uniform(self, k: int, seed: int) -> torch.Tensor:
        """``k`` distinct uniformly drawn landmark indices for ``seed``. ``(k,)`` long."""
        n, dev = self.X.shape[0], self.X.device
        return self._get(("uniform", k, seed), lambda: landmarks.uniform(n, k, seed=seed, device=dev))

    def knn(
        self, order_key: Hashable, rows: torch.Tensor | None, w: int, scale: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Causal kNN pattern (:func:`causal_knn`) of ``X[rows]`` (``rows=None``: all of X in data order).

        Args:
            order_key: hashable name of the ordering ``rows`` (it must determine ``rows``).
            rows: ``(m,)`` indices into X defining the order, or ``None``.
            w: pattern width.
            scale: ARD length-scales ``(d,)`` (see :func:`metric_scale`) or ``None`` for isotropic kernels.

        Returns:
            ``idx: (m, w)`` (indices into ``X[rows]``) and ``valid: (m, w)``.
        """
        skey = None if scale is None else tuple(float(s) for s in scale.tolist())

        def make() -> tuple[torch.Tensor, torch.Tensor]:
            Y = self.X if rows is None else self.X[rows]
            if scale is not None:
                Y = Y / scale.to(Y.dtype)
            return causal_knn(Y, w)

        return self._get(("knn", order_key, w, skey), make)
