"""Reuse of everything that depends only on the points ``X`` across hyperparameter steps.

FPS order, uniform landmark draws and causal kNN patterns do not depend on the noise, the outputscale or
(for isotropic kernels) the length-scale (the AFN paper, §4, picks FPS partly for this independence), so a GP
optimiser rebuilding AFN/FSAI every step can share one :class:`PointCache`. For ARD kernels the neighbour order
depends on the length-scale vector, so patterns are computed on ``X / lengthscale`` and reused while every
length-scale stays within a factor ``1 + scale_rtol`` of the vector the pattern was computed for. An exact key
would recompute the kNN search at every step, and, worse, make the estimated objective jump: a near-tie in the
neighbour order that flips under a tiny change of a length-scale changes the FSAI pattern, and with it
``log det P`` and the SLQ estimate, which keeps a quasi-Newton optimiser such as BoTorch's L-BFGS-B cycling near
the optimum (docs/bo.md, "Fixed FSAI patterns").
"""

from __future__ import annotations

import math
from typing import Any, Hashable

import gpytorch
import torch

from gpnys import landmarks
from gpnys.kernels.entries import split_outputscale
from gpnys.precond.knn import causal_knn

__all__ = ["pattern_scale", "PointCache", "metric_scale"]

_ARD_PATTERNS_KEPT = 4  # ARD patterns kept per (ordering, w): an optimiser's path rarely comes back further


def metric_scale(kernel: gpytorch.kernels.Kernel) -> torch.Tensor | None:
    """The ARD length-scale vector ``(d,)`` of a (unit-variance) stationary kernel, or ``None`` if isotropic.

    An isotropic length-scale only rescales all distances, so it leaves every neighbour order unchanged.
    """
    ls = getattr(kernel, "lengthscale", None) if getattr(kernel, "has_lengthscale", False) else None
    if ls is None or ls.numel() <= 1:
        return None
    return ls.detach().reshape(-1)


def pattern_scale(kernel: gpytorch.kernels.Kernel, X: torch.Tensor) -> torch.Tensor | None:
    """The metric in which the kNN patterns of ``X (n, d)`` are chosen: the ARD length-scales ``(d,)`` of ``kernel``
    (a ``ScaleKernel`` unwrapped; :func:`metric_scale`) in ``X``'s dtype and device, or ``None`` when it is isotropic
    or its length-scales do not match ``X``'s columns."""
    scale = metric_scale(split_outputscale(kernel)[0])
    if scale is None or scale.numel() != X.shape[-1]:
        return None
    return scale.to(device=X.device, dtype=X.dtype)


class PointCache:
    """Caches landmarks and kNN patterns of fixed points ``X (n, d)``; ``hits``/``misses`` count reuse.

    * :meth:`fps` — FPS order computed once for the largest ``k`` asked; smaller ``k`` reuse the prefix
      (the FPS order of the first ``k`` points is a prefix of the longer order).
    * :meth:`uniform` — uniform landmark draws keyed by ``(k, seed)``.
    * :meth:`knn` — causal kNN patterns keyed by ``(ordering key, w)`` and, for ARD kernels, reused for every
      length-scale vector within a factor ``1 + scale_rtol`` (per component) of the one they were computed for.

    Args:
        X: ``(n, d)`` points.
        scale_rtol: ARD pattern reuse tolerance (``0``: recompute for every distinct length-scale vector).

    Example:
        >>> import torch
        >>> from gpnys.landmarks import fps
        >>> from gpnys.precond import PointCache
        >>> X = torch.rand(200, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> cache = PointCache(X)
        >>> first = cache.fps(20)
        >>> torch.equal(first, fps(X, 20).indices), torch.equal(cache.fps(5), first[:5])  # a prefix, reused
        (True, True)
        >>> idx, valid = cache.knn("data", None, 8)  # the causal kNN pattern of X in data order, w = 8
        >>> cache.knn("data", None, 8)[0] is idx
        True
        >>> cache.hits, cache.misses
        (2, 2)
    """

    def __init__(self, X: torch.Tensor, scale_rtol: float = 0.1) -> None:
        if not scale_rtol >= 0:
            raise ValueError(f"scale_rtol must be >= 0, got {scale_rtol!r}")
        self.X = X
        self.scale_rtol = float(scale_rtol)
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

    def _near(self, key: Hashable, scale: torch.Tensor) -> list:
        """The stored ``[log length-scales, value]`` of ``key`` whose length-scales are closest to ``scale`` (the
        largest per-component log ratio) if within a factor ``1 + scale_rtol``, else a new one for ``scale`` (value
        ``None``); the last :data:`_ARD_PATTERNS_KEPT` are kept."""
        scaled = self._store.setdefault(key, [])
        log_s = scale.detach().log()
        gaps = [float((log_s - ref).abs().max()) for ref, _ in scaled]
        best = min(range(len(gaps)), key=gaps.__getitem__, default=None)
        if best is not None and gaps[best] <= math.log1p(self.scale_rtol):
            return scaled[best]
        scaled.append([log_s, None])
        del scaled[:-_ARD_PATTERNS_KEPT]
        return scaled[-1]

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
            scale: ARD length-scales ``(d,)`` (see :func:`metric_scale`) or ``None`` for isotropic kernels. With a
                scale, a stored pattern for this ordering and ``w`` is returned when every length-scale is within a
                factor ``1 + scale_rtol`` of its own (the closest one if several), else a new one is computed on
                ``X[rows] / scale``.

        Returns:
            ``idx: (m, w)`` (indices into ``X[rows]``) and ``valid: (m, w)``.
        """
        def make() -> tuple[torch.Tensor, torch.Tensor]:
            Y = self.X if rows is None else self.X[rows]
            if scale is not None:
                Y = Y / scale.to(Y.dtype)
            return causal_knn(Y, w)

        if scale is None:
            return self._get(("knn", order_key, w, None), make)
        entry = self._near(("knn-ard", order_key, w), scale)  # ARD: the closest stored length-scales, if near
        if entry[1] is not None:
            self.hits += 1
        else:
            self.misses += 1
            entry[1] = make()
        return entry[1]
