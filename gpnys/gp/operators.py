"""The GPyTorch objects the training hook hands to GPyTorch: the preconditioner as a ``LinearOperator`` for probe
sampling, the marginal whose ``log_prob`` adds the control variate, and the covariance whose override survives
``evaluate_kernel()`` (see :mod:`gpnys.gp.hook`)."""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import TYPE_CHECKING, Any, Callable

import gpytorch
import torch
from linear_operator.operators import AddedDiagLinearOperator, LinearOperator
from linear_operator.utils.cholesky import psd_safe_cholesky

from gpnys.checks import NumericalWarning
from gpnys.linalg import small_dense
from gpnys.precond.base import Preconditioner

if TYPE_CHECKING:
    from gpnys.gp.problem import TrainingProblem
    from gpnys.gp.settings import EstimatorSettings

__all__ = ["PreconditionerOperator", "PreconditionedMVN", "BatchPreconditionedMVN", "CholeskyMVN",
           "PreconditionedAddedDiag", "CallerSettingsMVN"]


class PreconditionerOperator(LinearOperator):
    """``scale * P`` as a symmetric ``LinearOperator`` (``(n, n)``), for GPyTorch's probe sampling.

    ``zero_mean_mvn_samples(num)`` draws ``sqrt(scale) R z`` (``P = R R^T``, ``z`` Gaussian or Rademacher, both
    with covariance ``scale P``) through the preconditioner's factor and passes the draws ``(n, num)`` to
    ``on_sample`` when given.
    """

    def __init__(
        self,
        scale: torch.Tensor,
        precond: Preconditioner,
        on_sample: Callable[[torch.Tensor], None] | None = None,
        distribution: str = "gaussian",
    ) -> None:
        super().__init__(scale, precond=precond, on_sample=on_sample, distribution=distribution)
        self.scale = scale
        self.precond = precond
        self.on_sample = on_sample
        self.distribution = distribution

    def _matmul(self, rhs: torch.Tensor) -> torch.Tensor:
        return self.scale * self.precond.matmul(rhs)

    def _size(self) -> torch.Size:
        return torch.Size([self.precond.n, self.precond.n])

    def _transpose_nonbatch(self) -> "PreconditionerOperator":
        return self

    def zero_mean_mvn_samples(self, num_samples: int) -> torch.Tensor:
        Z = self.scale.sqrt() * self.precond.sample(num_samples, distribution=self.distribution)  # (n, num)
        if self.on_sample is not None:
            self.on_sample(Z)
        return Z.mT


class PreconditionedMVN(gpytorch.distributions.MultivariateNormal):
    """The marginal ``N(m, K̂)`` whose ``log_prob`` is gpnys's estimate with error bars
    (:func:`gpnys.gp.estimator.log_prob`, with ``settings.error_bars``), else GPyTorch's with the control variate.

    ``log_prob = GPyTorch's log_prob − ½ (C − stop_grad(C))``: the value is unchanged, the gradient of the
    log-determinant term becomes the variance-reduced estimator
    (:meth:`~gpnys.gp.problem.TrainingProblem.control_variate`).
    """

    _gpnys_problem: "TrainingProblem | None" = None

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        problem = self._gpnys_problem
        if problem is None:
            return self._log_prob(value, None)
        with problem.settings.context():  # the hook's CG + SLQ, for this marginal only
            return self._log_prob(value, problem)

    def _log_prob(self, value: torch.Tensor, problem: "TrainingProblem | None") -> torch.Tensor:
        if problem is None:
            return self._gpytorch_log_prob(value, None)
        problem.last_probes = None
        with problem.paths.timed() as stamp:  # either form times the preconditioned path for the cost model
            if problem.settings.error_bars and value.shape == self.mean.shape and self.mean.dim() == 1:
                return stamp(problem.evaluate(self, value))  # per-probe terms: error bars, requested accuracy
            res = stamp(self._gpytorch_log_prob(value, problem))
        problem.record_unbarred(res.detach())
        return res

    def _gpytorch_log_prob(self, value: torch.Tensor, problem: "TrainingProblem | None") -> torch.Tensor:
        """GPyTorch's ``log_prob`` under the hook's settings, with the probe seed and the control variate."""
        seed = None if problem is None else problem.settings.probe_seed
        if seed is None:
            res = super().log_prob(value)
        else:
            with torch.random.fork_rng(devices=[value.device] if value.device.type == "cuda" else []):
                torch.manual_seed(seed)
                res = super().log_prob(value)
        if (problem is not None and problem.variance_reduction and not problem.preconditioners.stale
                and torch.is_grad_enabled()):
            C = problem.control_variate()
            if C is not None:
                res = res - 0.5 * (C - C.detach())
        return res


class BatchPreconditionedMVN(gpytorch.distributions.MultivariateNormal):
    """The training marginal of a batch-mode model, ``N(m_i, K̂_i)`` for ``i < b`` (mean ``(b, n)``): ``log_prob``
    runs gpnys's estimator on each element with its own preconditioner (:class:`~gpnys.gp.problem.BatchElement`)
    and returns the ``(b,)`` log-likelihoods; ``hook.last_estimate`` is their sum
    (:meth:`~gpnys.gp.estimator.Estimate.total`), ``hook.batch_estimates`` one per element."""

    _gpnys_problem: "TrainingProblem | None" = None

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        problem = self._gpnys_problem
        if problem is None or value.shape != self.mean.shape:
            return super().log_prob(value)
        cov = self.lazy_covariance_matrix
        op, diag = cov._linear_op, cov._diag_tensor.diagonal()
        dense = None if problem.batch_closed_form(op) else op.evaluate_kernel()  # GPyTorch's own (b, n, n) then
        out = []
        with problem.paths.timed() as stamp, problem.settings.context():
            for element in problem.elements:
                i = element.index
                marginal = gpytorch.distributions.MultivariateNormal(self.mean[i],
                                                                     element.covariance(op, dense, diag[i]))
                out.append(element.evaluate(marginal, value[i]))
            result = stamp(torch.stack(out))
        problem.record_batch([element.last_estimate for element in problem.elements])
        return result


class CholeskyMVN(gpytorch.distributions.MultivariateNormal):
    """The training marginal on the Cholesky path (:mod:`gpnys.gp.path`): GPyTorch's own ``log_prob`` with its dense
    Cholesky forced; ``hook.last_estimate`` records the exact value (standard errors 0, ``path="cholesky"``), or NaN
    standard errors where GPyTorch had to add jitter (one warning)."""

    _gpnys_problem: "TrainingProblem | None" = None

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        problem = self._gpnys_problem
        if problem is None:
            res, jittered = self._log_prob(value)
        else:
            with problem.paths.timed_exact() as stamp:  # its seconds, against the preconditioned prediction
                res, jittered = self._log_prob(value)
                res = stamp(res)
            problem.record_exact(res.detach(), res.requires_grad, jittered=jittered)
        return res

    def _log_prob(self, value: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """The log-likelihood, and whether its factorisation needed GPyTorch's jitter (one warning then)."""
        n = value.shape[-1]
        covar = self.lazy_covariance_matrix
        jittered = False
        if gpytorch.settings.fast_computations.log_prob.off() or value.shape[:-1] != covar.batch_shape:
            with gpytorch.settings.max_cholesky_size(n + 1), small_dense(n, value.device):
                res = super().log_prob(value)  # GPyTorch's own (its exact log_prob, or a broadcast batch)
        else:
            # GPyTorch's dense Cholesky computation, written out so that a factorisation that needs its jitter is
            # seen (psd_safe_cholesky only warns; capturing that warning would re-show every other one)
            with small_dense(n, value.device):
                K = covar.evaluate_kernel().to_dense()
                L, info = torch.linalg.cholesky_ex(K)
                if bool(info.any()):
                    jittered = True
                    L = psd_safe_cholesky(K)  # GPyTorch's jitter, with its own warning
            w = torch.linalg.solve_triangular(L, (value - self.loc).unsqueeze(-1), upper=False)
            logdet = 2.0 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)
            res = -0.5 * (w.square().sum((-2, -1)) + logdet + n * math.log(2 * math.pi))
        if jittered:
            # the value and gradient are those of K̂ + jitter·I, off from K̂'s by an amount nothing here measures
            # (float32 at a noise of 1e-8: a loss of 401 per point for 3.0e5): not exact, so no standard error of 0
            dtype = str(value.dtype).removeprefix("torch.")
            warnings.warn(f"gpnys: the Cholesky path needed GPyTorch's jitter: K̂ is not numerically positive definite "
                          f"in {dtype}; this loss and gradient are those of the jittered matrix, their standard errors "
                          "unknown (NaN); use float64 or a larger noise", NumericalWarning, stacklevel=3)
        return res, jittered


class CallerSettingsMVN(gpytorch.distributions.MultivariateNormal):
    """A training marginal the hook passes through: GPyTorch's own ``log_prob``, under the GPyTorch settings the
    caller had before entering the hook (``restore``: :func:`gpnys.gp.settings.current_gpytorch_settings`)."""

    def __init__(self, mean: torch.Tensor, covariance: LinearOperator, restore: Callable[[], Any]) -> None:
        super().__init__(mean, covariance)
        self._restore = restore

    def log_prob(self, value: torch.Tensor) -> torch.Tensor:
        with self._restore():
            return super().log_prob(value)


class PreconditionedAddedDiag(AddedDiagLinearOperator):
    """``K̂ = K + D`` of a hooked model: an ``AddedDiagLinearOperator`` whose ``preconditioner_override`` survives
    ``evaluate_kernel()``, and whose solves, log-determinants and root decompositions (GPyTorch's training loss and
    its prediction caches, ``mean_cache`` / ``covar_cache``) run under the hook's GPyTorch settings
    (``settings``: :class:`~gpnys.gp.settings.EstimatorSettings`, CG + SLQ at its tolerances). The settings are
    scoped to this operator, not set globally for the hook's context, so another model evaluated inside the
    context computes as its caller set it up."""

    def __init__(self, *linear_ops: LinearOperator, preconditioner_override: Callable | None = None,
                 settings: "EstimatorSettings | None" = None) -> None:
        super().__init__(*linear_ops, preconditioner_override=preconditioner_override)
        self._kwargs["settings"] = settings  # kept by linear_operator's rebuilds (``self.__class__(*args, **kwargs)``)

    def _scoped(self) -> contextlib.AbstractContextManager:
        settings = self._kwargs.get("settings")
        return contextlib.nullcontext() if settings is None else settings.context()

    def evaluate_kernel(self) -> "PreconditionedAddedDiag":
        evaluated = super().evaluate_kernel()
        return PreconditionedAddedDiag(evaluated._linear_op, evaluated._diag_tensor,
                                       preconditioner_override=self.preconditioner_override,
                                       settings=self._kwargs.get("settings"))

    def solve(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        with self._scoped():
            return super().solve(*args, **kwargs)

    def inv_quad_logdet(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        with self._scoped():
            return super().inv_quad_logdet(*args, **kwargs)

    def root_decomposition(self, *args: Any, **kwargs: Any) -> LinearOperator:
        with self._scoped():
            return super().root_decomposition(*args, **kwargs)

    def root_inv_decomposition(self, *args: Any, **kwargs: Any) -> LinearOperator:
        with self._scoped():
            return super().root_inv_decomposition(*args, **kwargs)

    def cholesky(self, *args: Any, **kwargs: Any) -> LinearOperator:
        """linear_operator's dense Cholesky of ``K̂``, as GPyTorch's own computation takes it, with one warning: a
        caller that factors the covariance itself (``LeaveOneOutPseudoLikelihood``, a user's ``cholesky()``) gets
        nothing from the preconditioner (Python's default filter shows the warning once)."""
        warnings.warn("gpnys: the hooked training covariance is factored by a dense Cholesky (a computation other than "
                      "a marginal log likelihood's log_prob, such as LeaveOneOutPseudoLikelihood): it runs as "
                      "GPyTorch's own, without the preconditioner", NumericalWarning, stacklevel=2)
        return super().cholesky(*args, **kwargs)
