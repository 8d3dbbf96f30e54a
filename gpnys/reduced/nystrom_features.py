"""Nyström features as a scikit-learn transformer: the NSL / LLA kernel machine with any linear learner.

[NSL] Algorithm 1 learns an ``s``-dimensional orthonormal basis ``B~* = C_H V_(s) Sigma_(s)^{-1}`` of the span of
the landmarks in feature space (``K_mm = V Sigma^2 V^T``); projecting every point on it gives the features

    phi(x) = Sigma_(s)^{-1} V_(s)^T k(C, x)          ([NSL] eq. (8), (16), Algorithm 2 step 2)

whose Gram matrix is the rank-s Nyström kernel ``K_nm W_(s)^+ K_mn`` ([NSL] eq. (1), (10)). A linear SVM (or any
L2-regularised linear model) on ``phi`` is LLA = NSL + linear SVM learning ([NSL] §3.3); with ``s = rank K_mm`` it
is NCR ([NSL] §3.5, Prop 3). ``basis="standard"`` gives the symmetric-root features ``K_nm (W_(s)^+)^{1/2}``
([NSL] §2.1; scikit-learn's ``Nystroem``): the same Gram matrix, ``m`` columns instead of ``s``, and the same
L2-regularised linear model, rotated by ``V_(s)``. (The estimator [NSL] calls "the standard Nyström", Gram
substitution over ``span(X_H)``, is :class:`~gpnys.reduced.gsa.GSAPosterior`.)
"""

from __future__ import annotations

import copy
from typing import Any

import gpytorch
import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassNamePrefixFeaturesOutMixin, TransformerMixin
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from gpnys.checks import validate_array, validate_choice, validate_count, validate_points, validate_positive
from gpnys.kernels import KERNEL_NAMES, base_kernel
from gpnys.landmarks import RULES, select_landmarks
from gpnys.reduced.lla import NystromFeatureMap

__all__ = ["NystromFeatures", "median_lengthscale", "BASES"]

BASES = ("orthonormal", "standard")
DTYPES = {"float64": torch.float64, "float32": torch.float32}
_NUMPY = {torch.float64: np.float64, torch.float32: np.float32}


#: kernels that depend on ``x - x'`` only, and the containers that keep that (:func:`_shift_invariant`)
_STATIONARY = (gpytorch.kernels.RBFKernel, gpytorch.kernels.MaternKernel, gpytorch.kernels.RQKernel,
               gpytorch.kernels.PeriodicKernel, gpytorch.kernels.SpectralMixtureKernel, gpytorch.kernels.CosineKernel)
_CONTAINERS = (gpytorch.kernels.ScaleKernel, gpytorch.kernels.AdditiveKernel, gpytorch.kernels.ProductKernel)


def _shift_invariant(kernel: gpytorch.kernels.Kernel) -> bool:
    """Whether ``kernel`` depends on its inputs through ``x - x'`` alone (stationary kernels, their scales, sums
    and products); an unknown kernel counts as not."""
    if type(kernel) in _STATIONARY:
        return True
    if isinstance(kernel, gpytorch.kernels.ScaleKernel):
        return _shift_invariant(kernel.base_kernel)
    if type(kernel) in _CONTAINERS:  # sums and products hold their parts in ``kernels`` (a ModuleList)
        parts = list(getattr(kernel, "kernels", []))
        return bool(parts) and all(_shift_invariant(k) for k in parts)
    return False


MEDIAN_SAMPLE = 1000


def median_lengthscale(X: torch.Tensor, seed: int = 0, sample: int = MEDIAN_SAMPLE) -> float:
    """Median heuristic: the median Euclidean distance between distinct rows of ``X (n, d)``.

    Computed on ``min(n, sample)`` rows drawn without replacement (seeded); ``1.0`` when all of them coincide.

    Example:
        >>> import torch
        >>> from gpnys.reduced.nystrom_features import median_lengthscale
        >>> X = torch.tensor([[0.0], [1.0], [3.0]], dtype=torch.float64)  # distances 1, 2, 3
        >>> median_lengthscale(X)
        2.0
    """
    validate_points(X)
    n = X.shape[0]
    if n > sample:
        g = torch.Generator(device=X.device).manual_seed(int(seed))
        X = X[torch.randperm(n, generator=g, device=X.device)[:sample]]
    scale = X.abs().max().clamp_min(torch.finfo(X.dtype).tiny)  # pdist squares: 1e20 in float32 would overflow
    d = torch.pdist(X / scale) * scale if X.shape[0] > 1 else X.new_zeros(1)
    med = float(d.median()) if d.numel() else 0.0
    return med if med > 0 else 1.0


def _dtype(value: Any) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value in DTYPES:
        return DTYPES[value]
    if isinstance(value, type) and value in (np.float64, np.float32):
        return DTYPES[value.__name__]
    raise ValueError(f"dtype must be one of {sorted(DTYPES)} (or the torch / numpy dtype), got {value!r}")


class NystromFeatures(ClassNamePrefixFeaturesOutMixin, TransformerMixin, BaseEstimator):
    """Nyström feature map ``phi(x) = A^T k(C, x)`` as a scikit-learn transformer ([NSL] Algorithm 1, eq. (1)/(10)).

    Args:
        kernel: ``"rbf"``, ``"matern12"``, ``"matern32"``, ``"matern52"`` (unit variance, GPyTorch's length-scale
            convention: RBF ``exp(-r^2 / (2 l^2))``, i.e. scikit-learn's ``gamma = 1 / (2 l^2)``), or any GPyTorch
            kernel object (copied at fit, never modified; its own hyperparameters are used).
        lengthscale: for a named kernel; ``None`` takes the median heuristic (median pairwise distance of up to
            1000 seeded training rows, :func:`median_lengthscale`).
        n_components: ``m``, the number of landmarks (``<= n``).
        rank: ``s <= m`` kept eigen-directions of ``K_mm`` (NSL truncation, [NSL] §3.2); ``None`` keeps all
            numerically nonzero ones.
        landmarks: rule of :func:`gpnys.landmarks.select_landmarks`: ``"uniform"``, ``"fps"``, ``"kmeans"``
            (clustered Nyström, [NSL] §3.7) or ``"leverage"`` (ridge leverage scores at ridge ``ridge``).
        basis: ``"orthonormal"``: ``A = V_s Sigma_s^{-1}``, ``s`` features ([NSL] eq. (8)); ``"standard"``:
            ``A = V_s Sigma_s^{-1} V_s^T``, the symmetric root ``K_nm (K_mm^+)^{1/2}``, ``m`` features.
        ridge: the ``lambda`` of the ridge leverage scores (``landmarks="leverage"`` only).
        dtype: ``"float64"`` (default) or ``"float32"``; device: torch device (``None``: the input's, CPU for numpy).
        random_state: ``None``, an int or a ``numpy.random.RandomState``: seeds the landmarks and the median.

    Attributes:
        landmarks_: ``(m, d)`` landmark tensor C (``components_`` is the same tensor, as in scikit-learn's
            ``Nystroem``); landmark_indices_: ``(m,)`` rows of X, or ``None`` for k-means.
        A_: ``(m, s)`` (orthonormal) or ``(m, m)`` (standard) projection, ``phi = k(X, C) A_``.
        rank_: ``s``; lengthscale_: the length-scale used (``None`` for a kernel object); kernel_: the kernel;
        n_features_in_: ``d``.
        center_: ``(d,)`` mean of the training rows (at least float64) that a shift-invariant kernel's features
            are computed relative to, so that float32 keeps the digits of inputs far from the origin (``None`` for
            other kernels).

    ``transform`` returns numpy for numpy (or list) input and a tensor on the fitted device for tensor input.

    Example:
        >>> import numpy as np, torch
        >>> from sklearn.pipeline import make_pipeline
        >>> from sklearn.svm import LinearSVC
        >>> from gpnys.reduced import NystromFeatures
        >>> rng = np.random.default_rng(0)
        >>> X = rng.normal(size=(300, 2))
        >>> y = (np.linalg.norm(X, axis=1) > 1.2).astype(int)  # a circle: not linearly separable
        >>> nys = NystromFeatures(n_components=40, landmarks="kmeans", random_state=0)
        >>> Phi = nys.fit_transform(X)
        >>> Phi.shape, Phi.dtype, nys.landmarks_.shape
        ((300, 40), dtype('float64'), torch.Size([40, 2]))

        ``Phi Phi^T`` is the Nyström kernel ``K_nm K_mm^+ K_mn``:

        >>> K = lambda A, B: nys.kernel_(A, B).to_dense().detach().numpy()
        >>> Xt, C = torch.as_tensor(X), nys.landmarks_
        >>> Knm = K(Xt, C)
        >>> np.allclose(Phi @ Phi.T, Knm @ np.linalg.pinv(K(C, C)) @ Knm.T, atol=1e-8)
        True

        A linear SVM on the features is the NSL kernel SVM:

        >>> clf = make_pipeline(NystromFeatures(n_components=40, random_state=0), LinearSVC()).fit(X, y)
        >>> bool(clf.score(X, y) > 0.95)
        True
    """

    def __init__(self, kernel: str | gpytorch.kernels.Kernel = "rbf", lengthscale: float | None = None,
                 n_components: int = 100, rank: int | None = None, landmarks: str = "uniform",
                 basis: str = "orthonormal", ridge: float = 1e-3, dtype: Any = "float64",
                 device: str | torch.device | None = None, random_state: Any = None) -> None:
        self.kernel = kernel
        self.lengthscale = lengthscale
        self.n_components = n_components
        self.rank = rank
        self.landmarks = landmarks
        self.basis = basis
        self.ridge = ridge
        self.dtype = dtype
        self.device = device
        self.random_state = random_state

    # -- input -------------------------------------------------------------------------------------------------
    def _as_tensor(self, X: Any, dtype: torch.dtype, device: torch.device | None, reset: bool,
                   center: torch.Tensor | None = None) -> tuple[torch.Tensor, bool]:
        """``X`` as a ``(n, d)`` tensor of ``dtype`` on ``device``, less ``center`` (``(d,)``, subtracted in at least
        float64 before the cast); ``True`` when the input was a tensor.

        Arrays go through scikit-learn's ``validate_data`` (its messages, prefixed ``"X: "``); ``reset`` sets
        ``n_features_in_``, otherwise ``X`` must have that many columns.
        """
        precise = torch.promote_types(dtype, torch.float64)
        if not isinstance(X, torch.Tensor):
            arr = validate_array(self, X, reset=reset, dtype=_NUMPY[dtype if center is None else precise])
            # a read-only array (a pandas frame's values, a memory map) is copied: torch shares no read-only memory
            Xt = torch.from_numpy(np.require(arr, requirements="W")).to(device=device)
            return (Xt if center is None else Xt - center.to(Xt)).to(dtype), False
        if X.is_complex() or X.dtype == torch.bool:
            raise ValueError(f"X: Complex or boolean data not supported, got {X.dtype}")
        X = X.detach().to(device=device if device is not None else X.device)
        if center is not None:
            X = X.to(precise if not X.is_floating_point() else torch.promote_types(X.dtype, precise))
        elif not X.is_floating_point():  # integers: their values, as numpy's are taken
            X = X.to(dtype)
        validate_points(X, "X")
        if reset:
            self.n_features_in_ = X.shape[1]
        elif X.shape[1] != self.n_features_in_:
            raise ValueError(f"X has {X.shape[1]} features, but {type(self).__name__} is expecting "
                             f"{self.n_features_in_} features as input.")
        return (X if center is None else X - center.to(X)).to(dtype), True

    def _seed(self) -> int:
        rs = self.random_state
        if isinstance(rs, (int, np.integer)) and not isinstance(rs, bool):
            return int(rs)
        return int(check_random_state(rs).randint(np.iinfo(np.int32).max))  # None: fresh; RandomState: drawn

    # -- fit / transform ---------------------------------------------------------------------------------------
    def fit(self, X: Any, y: Any = None) -> "NystromFeatures":
        """Choose the landmarks and the basis from ``X (n, d)``; ``y`` is ignored."""
        dtype = _dtype(self.dtype)
        device = None if self.device is None else torch.device(self.device)
        rs = self.random_state
        if not (rs is None or isinstance(rs, np.random.RandomState)
                or (isinstance(rs, (int, np.integer)) and not isinstance(rs, bool) and 0 <= int(rs) < 2**63)):
            raise ValueError(f"random_state must be None, a non-negative int or a RandomState, got {rs!r}")
        shift = isinstance(self.kernel, str) or _shift_invariant(self.kernel)
        if shift:
            # a stationary kernel sees differences only: the features are computed from centred points, whose
            # entries the dtype then holds to its precision (float32 inputs near 1e4 lost three digits and the
            # Gram matrix 0.18 of itself); the centre is the data's mean, taken in at least float64
            precise, _ = self._as_tensor(X, torch.promote_types(dtype, torch.float64), device, reset=True)
            self.center_ = precise.mean(0)
            Xt = (precise - self.center_).to(dtype)
        else:
            self.center_ = None
            Xt, _ = self._as_tensor(X, dtype, device, reset=True)
        n = Xt.shape[0]
        m = validate_count(self.n_components, "n_components", 1, n, "n (training rows)")
        if self.rank is not None:
            validate_count(self.rank, "rank", 1, m, "n_components")
        validate_choice(self.landmarks, "landmarks", RULES)
        validate_choice(self.basis, "basis", BASES)
        seed = self._seed()
        if isinstance(self.kernel, str):
            validate_choice(self.kernel, "kernel", KERNEL_NAMES, also="or a GPyTorch kernel")
            ell = median_lengthscale(Xt, seed) if self.lengthscale is None \
                else validate_positive(self.lengthscale, "lengthscale")
            kernel = base_kernel(self.kernel).to(device=Xt.device, dtype=dtype)
            kernel.lengthscale = ell
            self.lengthscale_ = ell
        elif isinstance(self.kernel, gpytorch.kernels.Kernel):
            if self.lengthscale is not None:
                raise ValueError("lengthscale applies to a named kernel only; set it on the kernel object")
            kernel = copy.deepcopy(self.kernel).to(device=Xt.device, dtype=dtype)
            self.lengthscale_ = None
        else:
            raise ValueError(f"kernel must be one of {sorted(KERNEL_NAMES)} or a GPyTorch kernel, got "
                             f"{type(self.kernel).__name__}")
        kernel.eval()
        noise = validate_positive(self.ridge, "ridge") if self.landmarks == "leverage" else None
        C, idx = select_landmarks(Xt, m, self.landmarks, kernel=kernel, noise=noise, seed=seed)
        fmap = NystromFeatureMap(kernel, C, rank=self.rank)
        A = fmap.A
        if self.basis == "standard":  # V_s Sigma_s^{-1} V_s^T: V_s = A with unit columns (A^T A = Sigma_s^{-2})
            A = A @ (A / A.norm(dim=0)).mT
        self.kernel_, self.feature_map_ = kernel, fmap
        # in the caller's coordinates (the feature map holds the centred ones)
        self.landmarks_ = self.components_ = C if self.center_ is None else (C.to(self.center_) + self.center_).to(C)
        self.landmark_indices_ = idx
        self.A_, self.rank_, self.dropped_ = A, fmap.s, fmap.dropped
        self._n_features_out = A.shape[1]
        return self

    def transform(self, X: Any) -> Any:
        """Features ``(n, s)`` (orthonormal) or ``(n, m)`` (standard) of the rows of ``X (n, d)``."""
        check_is_fitted(self, "A_")
        Xt, is_tensor = self._as_tensor(X, self.A_.dtype, self.A_.device, reset=False, center=self.center_)
        Phi = self.feature_map_.cross(Xt) @ self.A_
        return Phi if is_tensor else Phi.numpy(force=True)
