"""Predictions of a model under the training hook: the PCG predictive mean and exact-to-tolerance variances
(:meth:`HookPrediction.predict`), without GPyTorch's dense ``n x n`` prediction cache."""

from __future__ import annotations

from typing import Callable

import gpytorch
import torch

from gpnys.budget import block_rows
from gpnys.gp.discover import same_points, training_kernel
from gpnys.kernels.operator import StationaryKernelOperator
from gpnys.precond.base import safe_cholesky
from gpnys.solvers.pcg import pcg

__all__ = ["HookPrediction"]


class HookPrediction:
    """The prediction half of :class:`gpnys.gp.hook.PreconditionerHook` (a mixin: it uses the hook's ``system``,
    ``stationary_operator``, ``kernel``, ``settings`` and counters)."""

    def predict(self, test_x: torch.Tensor, variance: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Predictive mean and variance of ``y`` (noise included) at ``test_x (m, d)``: ``((m,), (m,))``.

        The mean is ``m(x) + k_x^T K̂^{-1} (y - m(X))``, one PCG solve with this preconditioner (relative
        residual 1e-6 in float64, 1e-5 in float32; GPyTorch's own prediction cache would form the dense
        ``n x n`` kernel), then test points in blocks of the memory budget. The variance
        ``k(x, x) - k_x^T K̂^{-1} k_x + noise`` is exact up to a tolerance, by the cheaper of two exact methods
        (``settings.variance_method = "auto"``; the choice is kept in ``variance_method_used``):

        * ``"pcg"``: the ``m`` systems ``K̂ B = K(X, test_x)`` by :func:`gpnys.solvers.pcg.pcg` with this
          preconditioner (warm start ``P̂^{-1} k_x``, tolerance ``settings.variance_tolerance``, column blocks of
          ``settings.variance_block``). The variational form ``2 b^T x - x^T K̂ x = b^T K̂^{-1} b - ||e||^2_K̂`` is
          second order in the error. Cost ``~ 2 n^2 m`` per iteration.
        * ``"cholesky"``: one Cholesky of ``K̂``, ``n^3/3 + n^2 m`` flops — cheaper than PCG as soon as
          ``m > n / (3 (2 iters - 1))`` (m > ~130 at n = 15 000 and 20 iterations), and only offered when the
          dense kernel is already cached (it needs one more ``n x n`` buffer). Training never uses it.

        A model whose ``forward`` transforms x gets GPyTorch's own predictive variances (the fast paths evaluate
        ``kernel(X, test_x)`` on the raw inputs). GPyTorch's LOVE was 10 % off in NLL on elevators, so it is
        not used.
        """
        model, lik = self.model, self.model.likelihood
        model.eval()
        lik.eval()
        with torch.no_grad(), self.settings.context():
            X = model.train_inputs[0]
            kx = self._kernel_x if self._kernel_x is not None else self._discovered_inputs()
            op = self.stationary_operator(X) if kx is not None else None
            if op is None or not same_points(kx, X):
                # GPyTorch's own path: a forward that transforms x, or a kernel without gpnys's operator
                if not variance:
                    with gpytorch.settings.skip_posterior_variances(True):
                        return lik(model(test_x)).mean, None
                self.variance_method_used = "gpytorch"
                pred = lik(model(test_x))
                return pred.mean, pred.variance
            kernel = self.kernel
            noise = self._noise().detach()
            n, m = X.shape[0], test_x.shape[0]
            alpha = self._mean_weights(X)
            # test-point blocks: (n, b) kernel columns within the memory budget (GPyTorch holds a few copies)
            block = min(self.settings.variance_block, max(64, block_rows(n, parts=4, device=X.device)))
            if not variance:
                mean = torch.cat([model.forward(T).mean + kernel(T, X) @ alpha for T in test_x.split(block)])
                return mean, None
            iters = max(10.0, self.applications / max(1, self.builds))  # CG iterations per training solve
            method = self.settings.variance_method
            if method == "auto":
                cheap = n / 3 + m < 2 * iters * m
                method = "cholesky" if cheap and op is not None and op._dense() is not None else "pcg"
            self.variance_method_used = method
            solve = self._cholesky_quad(op, noise) if method == "cholesky" else self._pcg_quad(X)
            means, out = [], []
            for T in test_x.split(block):
                Kxt = kernel(X, T).to_dense()  # (n, b)
                means.append(model.forward(T).mean + Kxt.mT @ alpha)
                out.append((kernel(T, diag=True) - solve(Kxt)).clamp_min(0.0))
        # y's variance adds the noise; per-point training noise says nothing about new points, and GPyTorch's
        # FixedNoiseGaussianLikelihood then returns the latent variance: so does this
        return torch.cat(means), torch.cat(out) + (noise if noise.dim() == 0 else 0.0)

    def _discovered_inputs(self) -> torch.Tensor | None:
        """The inputs the kernel sees, read from the covariance ``forward`` builds
        (:func:`~gpnys.gp.discover.training_kernel`), for a model that was not trained under this hook (a fitted model
        loaded for prediction): without them :meth:`predict` would take GPyTorch's path, which forms the dense
        ``n x n`` kernel. ``None`` when the covariance is not one kernel call (GPyTorch's path then)."""
        try:
            self._seen = training_kernel(self.model)
        except ValueError:
            return None
        return self._seen[1]

    def _mean_weights(self, X: torch.Tensor) -> torch.Tensor:
        """``alpha = K̂^{-1} (y - m(X))`` (``(n,)``) by PCG with this preconditioner: the predictive mean is
        ``m(x) + k_x^T alpha``. Not GPyTorch's prediction cache, which evaluates the dense ``n x n`` kernel."""
        A, M = self.system(X)
        r = (self.model.train_targets - self.model.forward(X).mean)[:, None]
        tol = 1e-6 if X.dtype == torch.float64 else 1e-5
        res = pcg(A, r, precond=M, x0=M(r), tol=tol, maxiter=self.settings.max_cg_iterations)
        return res.x[:, 0]

    def _pcg_quad(self, X: torch.Tensor) -> Callable:
        """``B -> diag(B^T K̂^{-1} B)`` by PCG (see :meth:`predict`)."""
        A, M = self.system(X)

        def quad(B: torch.Tensor) -> torch.Tensor:
            res = pcg(A, B, precond=M, x0=M(B),
                      tol=self.settings.variance_tolerance, maxiter=self.settings.max_cg_iterations)
            self.variance_iterations = res.iterations
            return (B * res.x).sum(0) + (res.x * (B - A(res.x))).sum(0)  # 2 b'x - x'Ax

        return quad

    def _cholesky_quad(self, op: StationaryKernelOperator, noise: torch.Tensor) -> Callable:
        """``B -> diag(B^T K̂^{-1} B)`` through one Cholesky of the cached dense ``K̂`` (see :meth:`predict`)."""
        K = op._dense()[0] * op.outputscale.detach()
        K.diagonal().add_(noise)
        L = safe_cholesky(K, "predictive covariance K + noise I")
        del K

        def quad(B: torch.Tensor) -> torch.Tensor:
            return torch.linalg.solve_triangular(L, B, upper=False).square().sum(0)

        return quad
