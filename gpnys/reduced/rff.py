"""Random Fourier features (Rahimi & Recht 2007; [YANG] Yang et al. 2012 §2) and the GP on them.

Bochner: a stationary kernel ``s^2 k(x - x')`` is ``s^2 E_omega[cos(omega^T (x - x'))]`` for ``omega`` drawn from
its normalised spectral density. With ``D`` draws ``Omega (D, d)`` the features

    phi(x) = sqrt(s^2 / D) [cos(Omega x); sin(Omega x)]   in R^{2D}                      ([YANG] eq. (3), scaled)

give ``phi(x)^T phi(x') = (s^2 / D) sum_i cos(omega_i^T (x - x')) -> s^2 k(x, x')``: the normalised form
([YANG] §2's features carry no ``1 / sqrt(D)``, so their inner product is ``D`` times the kernel), in GPyTorch
``RFFKernel``'s order, all cosines then all sines, divided by ``sqrt(D)``.

Frequencies follow GPyTorch's length-scale convention (``r = ||(x - x') / l||``, one ``l`` or one per dimension;
[YANG] §2 draws ``N(0, sigma^{-2} I)`` for ``exp(-||x - x'||^2 / (2 sigma^2))``, the same convention):
``omega = g / l`` with ``g ~ N(0, I_d)`` for RBF ``exp(-r^2 / 2)``. The Matérn-``nu`` spectral density
``∝ (2 nu + ||l o omega||^2)^{-(nu + d/2)}`` is a multivariate Student-t with ``2 nu`` degrees of freedom, so
``omega = g sqrt(2 nu / u) / l`` with ``u ~ chi^2_{2 nu}`` independent of ``g``. For the supported
``nu in {1/2, 3/2, 5/2}`` the degrees of freedom ``2 nu`` are integers and ``u`` is drawn exactly as a sum of
``2 nu`` squared standard normals from the same seeded generator (``torch``'s Gamma sampler takes no generator).

Only the standardised draws ``g`` and ``u`` are stored; length-scale and outputscale are read from the kernel at
every call, so one set of draws serves changed hyperparameters.
"""

from __future__ import annotations

import math

import gpytorch
import torch

from gpnys.checks import validate_choice, validate_count
from gpnys.kernels.entries import split_outputscale
from gpnys.kernels.operator import supported
from gpnys.landmarks.common import generator
from gpnys.reduced.features import FeatureGP, Solver
from gpnys.reduced.lla import _finite_2d, validate_regression

__all__ = ["MATERN_NUS", "RFFPosterior", "RandomFourierFeatures"]

#: Matérn smoothness values whose spectral draws are supported (integer degrees of freedom ``2 nu``)
MATERN_NUS = (0.5, 1.5, 2.5)


def _base_and_nu(kernel: gpytorch.kernels.Kernel) -> tuple[gpytorch.kernels.Kernel, float | None]:
    """The unit-variance base kernel (RBF or Matérn) and its ``nu`` (``None`` for RBF); ``ValueError`` otherwise."""
    base, _ = split_outputscale(kernel)
    if not supported(base):
        raise ValueError(
            "kernel must be a (ScaleKernel over a) plain RBFKernel or MaternKernel without batch shape or "
            f"active_dims, got {type(kernel).__name__}({type(base).__name__})"
        )
    if isinstance(base, gpytorch.kernels.RBFKernel):
        return base, None
    return base, validate_choice(float(base.nu), "kernel: Matérn nu", MATERN_NUS)


class RandomFourierFeatures:
    """Seeded random Fourier feature map ``phi: R^d -> R^{2D}`` for an RBF or Matérn kernel (module docstring).

    Args:
        kernel: ``ScaleKernel`` over ``RBFKernel`` or ``MaternKernel`` (``nu`` 0.5/1.5/2.5), isotropic or ARD;
            a bare base kernel means outputscale 1.
        d: input dimension (must equal the ARD dimension, if any).
        num_frequencies: ``D`` frequencies, hence ``2D`` features.
        seed: generator seed; the same seed, dtype and device give the same draws.
        dtype: of the stored draws (default ``torch.get_default_dtype()``); every call computes in its input's
            dtype and device.
        device: of the stored draws (default CPU). :class:`RFFPosterior` draws in at least float64, so one seed
            gives the same frequencies for float32 and float64 data.

    Attributes:
        G: ``(D, d)`` standard normal draws; u: ``(D,)`` chi-square draws with ``2 nu`` degrees of freedom
        (Matérn) or ``None`` (RBF); nu: Matérn smoothness or ``None``; num_features: ``2D``.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.reduced import RandomFourierFeatures
        >>> X = torch.rand(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> kernel.outputscale = 2.0
        >>> phi = RandomFourierFeatures(kernel, d=2, num_frequencies=50, seed=0, dtype=torch.float64)
        >>> Phi, Omega = phi(X), phi.frequencies()
        >>> Phi.shape, Omega.shape
        (torch.Size([4, 100]), torch.Size([50, 2]))

        ``phi(x)^T phi(x') = (s^2 / D) sum_i cos(omega_i^T (x - x'))``, a Monte Carlo estimate of ``s^2 k(x, x')``:

        >>> diff = X[:, None, :] - X[None, :, :]
        >>> torch.allclose(Phi @ Phi.mT, 2.0 / 50 * torch.cos(diff @ Omega.mT).sum(-1))
        True
        >>> Phi = RandomFourierFeatures(kernel, 2, 20000, seed=0, dtype=torch.float64)(X)
        >>> bool((Phi @ Phi.mT - kernel(X).to_dense().detach()).abs().max() < 0.05)
        True
    """

    def __init__(self, kernel: gpytorch.kernels.Kernel, d: int, num_frequencies: int, seed: int = 0,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        base, self.nu = _base_and_nu(kernel)
        self.d = validate_count(d, "d")
        self.num_frequencies = validate_count(num_frequencies, "num_frequencies")
        ard = base.ard_num_dims
        if ard is not None and ard != self.d:
            raise ValueError(f"d={self.d} does not match the kernel's ard_num_dims={ard}")
        self.kernel, self.seed = kernel, int(seed)
        dtype = torch.get_default_dtype() if dtype is None else dtype
        device = torch.device("cpu") if device is None else torch.device(device)
        gen = generator(self.seed, device)
        self.G = torch.randn(self.num_frequencies, self.d, generator=gen, dtype=dtype, device=device)
        self.u = None
        if self.nu is not None:
            dof = round(2 * self.nu)
            chi = torch.randn(self.num_frequencies, dof, generator=gen, dtype=dtype, device=device)
            self.u = chi.square().sum(1)

    @property
    def num_features(self) -> int:
        return 2 * self.num_frequencies

    def _lengthscale(self, like: torch.Tensor) -> torch.Tensor:
        """Current length-scale(s) as ``(1,)`` or ``(d,)`` in ``like``'s dtype and device."""
        base, _ = split_outputscale(self.kernel)
        return base.lengthscale.detach().reshape(-1).to(dtype=like.dtype, device=like.device)

    def _unit_frequencies(self, like: torch.Tensor) -> torch.Tensor:
        """Frequencies for unit length-scales, ``g sqrt(2 nu / u)`` (RBF: ``g``): ``(D, d)`` like ``like``."""
        G = self.G.to(dtype=like.dtype, device=like.device)
        if self.u is None:
            return G
        u = self.u.to(dtype=like.dtype, device=like.device)
        return G * (2.0 * self.nu / u).sqrt()[:, None]

    def frequencies(self, like: torch.Tensor | None = None) -> torch.Tensor:
        """``Omega (D, d)`` at the kernel's current length-scale (row ``i``: ``omega_i = g_i sqrt(2 nu / u_i) / l``),
        in the dtype/device of ``like`` (default: the stored draws)."""
        like = self.G if like is None else like
        return self._unit_frequencies(like) / self._lengthscale(like)

    def __call__(self, X: torch.Tensor, name: str = "X") -> torch.Tensor:
        """Features ``(n, 2D)`` = ``sqrt(s^2 / D) [cos(X Omega^T), sin(X Omega^T)]`` of ``X (n, d)``, in X's dtype.

        ``name`` is the argument named in ``ValueError`` messages.
        """
        _finite_2d(X, name)
        if X.shape[1] != self.d:
            raise ValueError(f"{name} must have d={self.d} columns, got {X.shape[1]}")
        _, outputscale = split_outputscale(self.kernel)
        with torch.no_grad():
            P = (X / self._lengthscale(X)) @ self._unit_frequencies(X).mT
            return torch.cat([P.cos(), P.sin()], dim=1).mul_(math.sqrt(outputscale / self.num_frequencies))


class RFFPosterior:
    """GP regression with the random-feature kernel ``phi(x)^T phi(x')`` (Bayesian linear model on the features).

    Mean ``m + phi_z^T w_hat`` and latent variance ``sigma^2 phi_z^T (Phi^T Phi + sigma^2 I)^{-1} phi_z`` — the exact
    GP posterior of the approximate kernel (:class:`~gpnys.reduced.features.FeatureGP`).

    Args:
        kernel: as :class:`RandomFourierFeatures`, at the chosen hyperparameters.
        X: ``(n, d)``; y: ``(n,)`` in X's dtype; noise: ``sigma^2 > 0``; num_frequencies: ``D`` (``2D`` features).
        seed: frequency seed; prior_mean: constant prior mean (subtracted from y, added to predictions).
        solver: optional ``solver(M, B)`` for the ``2D x 2D`` system (default Cholesky).

    Attributes:
        features: the :class:`RandomFourierFeatures`; Phi: ``(n, 2D)``; gp: the :class:`FeatureGP`;
        w: ``(2D,)`` posterior mean of the weights; num_features: ``2D``.

    Example:
        >>> import gpytorch, torch
        >>> g = torch.Generator().manual_seed(0)
        >>> X = 4 * torch.rand(200, 2, dtype=torch.float64, generator=g)
        >>> y = torch.sin(X[:, 0]) + 0.1 * torch.randn(200, dtype=torch.float64, generator=g)
        >>> Z = 4 * torch.rand(5, 2, dtype=torch.float64, generator=g)  # test points
        >>> kernel = gpytorch.kernels.ScaleKernel(gpytorch.kernels.RBFKernel()).double()
        >>> k = lambda A, B: kernel(A, B).to_dense().detach()  # dense kernel blocks, for the checks
        >>> from gpnys.reduced import RFFPosterior
        >>> rff = RFFPosterior(kernel, X, y, 0.01, num_frequencies=100, seed=0)
        >>> rff.num_features
        200
        >>> w = torch.linalg.solve(rff.Phi.mT @ rff.Phi + 0.01 * torch.eye(200, dtype=torch.float64), rff.Phi.mT @ y)
        >>> torch.allclose(rff.mean(Z), rff.features(Z) @ w)  # ridge regression on the features
        True
    """

    method = "rff"

    def __init__(self, kernel: gpytorch.kernels.Kernel, X: torch.Tensor, y: torch.Tensor, noise: float,
                 num_frequencies: int, seed: int = 0, prior_mean: float = 0.0, solver: Solver | None = None) -> None:
        validate_regression(X, y, noise, prior_mean=prior_mean)
        self.kernel, self.X, self.noise, self.prior_mean = kernel, X, float(noise), float(prior_mean)
        self.features = RandomFourierFeatures(kernel, X.shape[1], num_frequencies, seed=seed,
                                              dtype=torch.promote_types(X.dtype, torch.float64),
                                              device=X.device)
        self.num_features = self.features.num_features
        self.Phi = self.features(X)
        self.residual = y - self.prior_mean
        self.gp = FeatureGP(self.Phi, self.residual, self.noise, solver)
        self.w = self.gp.w

    def mean(self, Z: torch.Tensor) -> torch.Tensor:
        """Predictive mean ``(nz,)`` at ``Z (nz, d)``."""
        return self.prior_mean + self.gp.mean(self.features(Z, "Z"))

    def variance(self, Z: torch.Tensor) -> torch.Tensor:
        """Latent (noise-free) predictive variance ``(nz,)`` at ``Z (nz, d)``: ``FeatureGP.sor_variance``."""
        return self.gp.sor_variance(self.features(Z, "Z"))
