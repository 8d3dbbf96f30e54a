"""``s^2 k(X, X; l)`` as a ``LinearOperator`` with a blocked, closed-form hyperparameter derivative.

GPyTorch's CG path evaluates the training kernel as a dense tensor *with autograd*: every elementwise step of the
kernel (distances, exponentials, polynomial factors, ...) keeps an ``n x n`` temporary for the backward pass —
about 16 GB at n = 15 000 for a Matérn-3/2 ARD kernel, and the backward through them was half of a training step
(measured 10.5 of 21 s at elevators n = 14 940). :class:`StationaryKernelOperator` instead

* keeps the ``n x n`` unit-variance kernel ``K`` and ``H = k'(R)/R`` (below; RBF's ``H = -K`` is not stored)
  without autograd, computed in one pass (or, above ``dense_limit_bytes``, recomputes row blocks on the fly:
  memory ``O(b n)``);
* answers ``_bilinear_derivative(U, V)`` — the only derivative GPyTorch's ``inv_quad_logdet`` asks for,
  ``d/dtheta sum_t u_t^T K v_t`` — in closed form, one row block at a time.

Closed form. For a stationary kernel ``k(r)`` with ``r^2 = sum_d (x_d - x'_d)^2 / l_d^2``, let ``h(r) = k'(r) / r``
(RBF: ``-exp(-r^2/2)``; Matérn-1/2: ``-exp(-r)/r``; 3/2: ``-3 exp(-sqrt3 r)``; 5/2:
``-(5/3)(1 + sqrt5 r) exp(-sqrt5 r)``). With ``W = U V^T`` and ``A = W o h(R)`` (elementwise) and ``z = x / l``,

    d/d l_d  sum_ij s^2 W_ij k(r_ij) = -(s^2 / l_d) sum_ij A_ij (z_id - z_jd)^2
                                     = -(s^2 / l_d) [z_d^T diag(A 1) z_d + z_d^T diag(A^T 1) z_d - 2 z_d^T A z_d],
    d/d s^2                          = sum_ij W_ij k(r_ij) = sum_t u_t^T K v_t,

each a pass over row blocks of ``A`` (``O(n^2 (t + d))`` flops, ``O(b n)`` memory). Written by hand because
neither GPyTorch nor linear_operator offers a kernel operator whose derivative avoids the autograd graph on CPU
(GPyTorch's KeOps kernels do so on GPUs only, through KeOps).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import gpytorch
import torch
from linear_operator.operators import LinearOperator

from gpnys.budget import block_rows, dense_limit_bytes as budget_dense_limit

__all__ = ["StationaryKernelOperator", "supported", "caches_dense"]


def caches_dense(n: int, itemsize: int, matern: bool, dense_limit_bytes: int | None = None) -> bool:
    """Whether :class:`StationaryKernelOperator` keeps the kernel dense for ``n`` points: ``K`` (and, for Matérn,
    ``H = k'/r``) of ``n x n`` entries of ``itemsize`` bytes within ``dense_limit_bytes`` (``None``: the budget's)."""
    limit = budget_dense_limit() if dense_limit_bytes is None else dense_limit_bytes
    return (2 if matern else 1) * n * n * itemsize <= limit


def _nu(base: gpytorch.kernels.Kernel) -> float | None:
    return None if isinstance(base, gpytorch.kernels.RBFKernel) else float(base.nu)


def supported(base: gpytorch.kernels.Kernel) -> bool:
    """True for a plain (unbatched, all-dimensions) GPyTorch RBF or Matérn kernel."""
    return (
        type(base) in (gpytorch.kernels.RBFKernel, gpytorch.kernels.MaternKernel)
        and base.active_dims is None
        and len(base.batch_shape) == 0
    )


def _k_and_h(r: torch.Tensor, nu: float | None, k: torch.Tensor, h: torch.Tensor | None) -> None:
    """Write ``k(r)`` and ``k'(r) / r`` of the unit-variance kernel into ``k`` and ``h`` (``r`` is overwritten);
    in place and without temporaries, because on CPU these elementwise passes over ``n x n`` are memory-bound
    and a fresh ``(b, n)`` allocation per block costs more than the arithmetic (page faults: a per-block
    ``r.neg()`` was half of a matmul's time). RBF has ``h = -k``, so its ``h`` is neither computed nor stored
    (``None``)."""
    if nu is None:
        torch.exp(r.square_().mul_(-0.5), out=k)
    elif nu == 0.5:
        torch.exp(r.neg_(), out=k)
        tiny = torch.finfo(r.dtype).tiny
        torch.div(k, r.clamp_(max=-tiny), out=h)  # -exp(-r) / r, with r = -r here
        h.masked_fill_(r >= -tiny, 0.0)
    elif nu == 1.5:
        r.mul_(-math.sqrt(3.0))  # r = -a, a = sqrt(3) r
        torch.exp(r, out=h)  # e = exp(-a)
        torch.addcmul(h, r, h, value=-1.0, out=k)  # (1 + a) e
        h.mul_(-3.0)
    else:
        r.mul_(math.sqrt(5.0))  # a
        torch.exp(torch.neg(r, out=k), out=k)  # e (k is scratch)
        torch.addcmul(k, r, k, out=h)  # (1 + a) e
        torch.addcmul(h, r.square_(), k, value=1.0 / 3.0, out=k)  # (1 + a + a^2/3) e
        h.mul_(-5.0 / 3.0)


class StationaryKernelOperator(LinearOperator):
    """``outputscale * k(X, X)`` (``(n, n)``) for a GPyTorch RBF/Matérn ``base`` kernel.

    Args:
        X: ``(n, d)`` inputs (no gradient is propagated to them).
        outputscale: 0-dim tensor ``s^2`` (carries autograd to the raw parameter).
        lengthscale: ``(1, 1)`` or ``(1, d)`` tensor, ``base.lengthscale`` (carries autograd).
        base: the unit-variance GPyTorch kernel whose current hyperparameters equal ``lengthscale``.
        cache: a dict shared across reconstructions (GPyTorch rebuilds operators from their representation) that
            holds the dense unit kernel for the current length-scale.
        dense_limit_bytes: cache the dense K (and, for Matérn, H) only up to this many bytes together; above,
            matmuls recompute row blocks. ``None``: the memory budget's (:mod:`gpnys.budget`, 4 GiB by default:
            Matérn n ~ 16 000 in float64, RBF n ~ 23 000). Row blocks follow the budget's ``block_bytes``.
    """

    def __init__(
        self,
        X: torch.Tensor,
        outputscale: torch.Tensor,
        lengthscale: torch.Tensor,
        *,
        base: gpytorch.kernels.Kernel,
        cache: dict[str, Any],
        dense_limit_bytes: int | None = None,
    ) -> None:
        limit = budget_dense_limit() if dense_limit_bytes is None else int(dense_limit_bytes)
        super().__init__(X, outputscale, lengthscale, base=base, cache=cache, dense_limit_bytes=limit)
        self.X, self.outputscale, self.lengthscale = X, outputscale, lengthscale
        self.base, self.cache = base, cache
        self.dense_limit_bytes = limit
        self.nu = _nu(base)

    # -- values -------------------------------------------------------------------------------------------
    def _block_rows(self) -> int:
        return block_rows(self.X.shape[0])

    def _scaled(self) -> torch.Tensor:
        """``z = (x - mean) / l`` (``(n, d)``); centring keeps ``(z_i - z_j)^2`` accurate in float32."""
        Z = (self.X - self.X.mean(0)) / self.lengthscale.detach().reshape(-1)
        self._zmax = float(Z.abs().max()) if Z.numel() else 0.0
        self._sq = Z.square().sum(1)
        return Z

    def _rows(self, Z: torch.Tensor, a: int, b: int, out: tuple[torch.Tensor, torch.Tensor | None],
              scratch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Write ``(k, h)`` on rows ``a:b`` into ``out``, two ``(b - a, n)`` blocks (``h`` is ``None`` for RBF,
        where it is ``-k``); ``scratch`` (``(>= b - a, n)``) holds the distances. Reusing the caller's buffers
        keeps a pass over ``n`` rows free of ``(b, n)`` allocations (glibc returns and re-faults them: slower,
        and peak RSS grows by the retained blocks)."""
        with torch.no_grad():
            sq = self._sq
            R = torch.addmm(sq[None, :], Z[a:b], Z.mT, alpha=-2.0, out=scratch[: b - a])
            R.add_(sq[a:b, None]).clamp_(min=0.0).sqrt_()  # the expanded (matmul) form of the distance
            R.diagonal(offset=a).zero_()  # ... leaves ~sqrt(eps) |z| on the diagonal
            if self.nu == 0.5:  # ... and on coincident points, where h = -exp(-r)/r would amplify it
                R.masked_fill_(R < math.sqrt(torch.finfo(R.dtype).eps) * self._zmax, 0.0)
            _k_and_h(R, self.nu, *out)
            return out

    def _workspace(self, rows: int, blocks: int) -> list[torch.Tensor]:
        """``blocks`` scratch buffers of ``(rows, n)`` for one pass over the kernel."""
        n = self.X.shape[0]
        return [self.X.new_empty(rows, n) for _ in range(blocks)]

    def _dense(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Cached dense ``(K, H)`` (unit kernel and ``k'/r``; ``H`` is ``None`` for RBF) for the current
        length-scale, or ``None`` if too big. The buffers are reused across length-scales (no fresh n^2
        allocation per training step)."""
        n = self.X.shape[0]
        if not caches_dense(n, self.X.element_size(), self.nu is not None, self.dense_limit_bytes):
            return None
        X = self.X  # the inputs (by identity and version) are part of the key, not only the length-scale
        key = (X._version, tuple(self.lengthscale.detach().reshape(-1).tolist()))
        if self.cache.get("X") is not X or self.cache.get("key") != key:
            K, H = self.cache.get("K"), self.cache.get("H")
            if K is None or K.shape != (n, n) or K.dtype != self.X.dtype or K.device != self.X.device:
                K = torch.empty(n, n, dtype=self.X.dtype, device=self.X.device)
                H = None
            if self.nu is None:
                H = None
            elif H is None:
                H = torch.empty_like(K)
            Z, bs = self._scaled(), self._block_rows()
            (scratch,) = self._workspace(min(bs, n), 1)
            for a in range(0, n, bs):
                self._rows(Z, a, min(a + bs, n), (K[a : a + bs], None if H is None else H[a : a + bs]), scratch)
            self.cache.update(X=X, key=key, K=K, H=H)
        return self.cache["K"], self.cache["H"]

    def _blocks(self):
        """Yield ``(a, K_rows, H_rows)`` over row blocks, from the cache or recomputed (``H_rows`` is ``None``
        for RBF)."""
        dense = self._dense()
        n, bs = self.X.shape[0], self._block_rows()
        if dense is None:
            Z = self._scaled()
            scratch, Kw, *Hw = self._workspace(min(bs, n), 2 if self.nu is None else 3)
        for a in range(0, n, bs):
            if dense is not None:
                yield a, dense[0][a : a + bs], None if dense[1] is None else dense[1][a : a + bs]
            else:  # the yielded blocks are views of the workspace, valid until the next step
                m = min(bs, n - a)
                yield (a, *self._rows(Z, a, a + m, (Kw[:m], Hw[0][:m] if Hw else None), scratch))

    def _unit_matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        dense = self._dense()
        if dense is not None:
            return dense[0] @ rhs
        return torch.cat([Kb @ rhs for _, Kb, _ in self._blocks()])

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        return self.outputscale.detach() * self._unit_matmul(rhs)

    def _size(self) -> torch.Size:
        n = self.X.shape[0]
        return torch.Size([n, n])

    def _transpose_nonbatch(self) -> "StationaryKernelOperator":
        return self

    def _diagonal(self) -> torch.Tensor:
        return self.outputscale.detach() * torch.ones(self.X.shape[0], dtype=self.X.dtype, device=self.X.device)

    # -- derivative ---------------------------------------------------------------------------------------
    def _bilinear_derivative(self, left_vecs: torch.Tensor, right_vecs: torch.Tensor) -> tuple[Any, ...]:
        """``d/d(outputscale, lengthscale) sum_t u_t^T K v_t`` in closed form (module docstring); ``None`` for X."""
        U, V = left_vecs.detach(), right_vecs.detach()
        if U.dim() == 1:
            U, V = U[:, None], V[:, None]
        return (None, *self.weighted_derivative(lambda a, b: U[a:b] @ V.mT))

    def weighted_derivative(self, weight_rows: Callable[[int, int], torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """``d/d(outputscale, lengthscale) sum_ij W_ij (s^2 K)_ij`` for a weight matrix ``W`` (``(n, n)``) given
        by row blocks: ``weight_rows(a, b)`` returns rows ``a:b`` of ``W`` (``(b - a, n)``), which this method
        overwrites. Returns tensors shaped like ``outputscale`` and ``lengthscale``."""
        s2 = self.outputscale.detach()
        ls = self.lengthscale.detach().reshape(-1)
        Z = self._scaled()
        # The expanded form below subtracts two sums of size ~|z|^2 whose difference is ~|z_i - z_j|^2: it is
        # accumulated in (at least) float64, or float32 loses digits once |z| >> the weighted pairs' distances.
        acc = torch.promote_types(Z.dtype, torch.float64)
        Za = Z.to(acc)
        n = Z.shape[0]
        d_s2 = Za.new_zeros(())
        cross = Za.new_zeros(Z.shape[1])
        diag_w = Za.new_zeros(n)  # (A 1)_i + (A^T 1)_i
        for a, Kb, Hb in self._blocks():
            b = Kb.shape[0]
            W = weight_rows(a, a + b)  # (b, n)
            d_s2 = d_s2 + (W[:, None, :] @ Kb[:, :, None]).sum(dtype=acc)  # row dots: no (b, n) temporary
            A = W.mul_(Kb).neg_() if Hb is None else W.mul_(Hb)  # RBF: A = W o H = -(W o K)
            A = A.to(acc)
            diag_w[a : a + b] += A.sum(1)
            diag_w += A.sum(0)
            cross += (Za[a : a + b] * (A @ Za)).sum(0)
        per_dim = (diag_w[:, None] * Za.square()).sum(0) - 2.0 * cross  # sum_ij A_ij (z_id - z_jd)^2
        d_s2 = d_s2.to(Z.dtype)
        d_ls = (-s2 * per_dim.to(Z.dtype) / ls)
        if ls.numel() == 1:
            d_ls = d_ls.sum()
        return d_s2.reshape(self.outputscale.shape), d_ls.reshape(self.lengthscale.shape)
