"""Exact GP regression with GPyTorch: the model, a training loop (Adam or L-BFGS) with checkpoints, prediction and
metrics.

By default :func:`fit` and :func:`predict` force GPyTorch's Cholesky path (``max_cholesky_size`` above n), so loss and
gradients are exact; under :func:`gpnys.gp.hook.use_preconditioner` pass ``settings`` to let the hook compute them.
``fit(..., loss=gpnys.baselines.exact.cholesky_loss)`` trains on the same exact loss with a closed-form gradient.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import gpytorch
import torch
from tqdm.auto import tqdm

from gpnys.checks import validate_choice, validate_training_data
from gpnys.kernels import make_kernel

__all__ = ["ExactGPModel", "FitResult", "fit", "predict", "gaussian_nll", "hyperparameters", "read_checkpoint",
           "exact_settings", "OPTIMIZERS"]

OPTIMIZERS = ("adam", "lbfgs")


class ExactGPModel(gpytorch.models.ExactGP):
    """``y = f(X) + eps``, ``f ~ GP(m, s^2 k_l)``, ``eps ~ N(0, sigma^2)``.

    Args:
        train_x: ``(n, d)``; train_y: ``(n,)``.
        likelihood: a ``GaussianLikelihood``.
        kernel: a name from :data:`gpnys.kernels.KERNEL_NAMES` (wrapped in a ``ScaleKernel``) or a kernel.
        ard: one length-scale per input dimension (only with a kernel name).
        mean: ``"constant"`` or ``"zero"``.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.gp import ExactGPModel
        >>> X = torch.rand(50, 3, dtype=torch.float64)
        >>> model = ExactGPModel(X, X.sum(-1), gpytorch.likelihoods.GaussianLikelihood(), kernel="matern32",
        ...                      ard=True).double()
        >>> model.covar_module.base_kernel.lengthscale.shape  # one length-scale per input dimension
        torch.Size([1, 3])
    """

    def __init__(
        self,
        train_x: torch.Tensor,
        train_y: torch.Tensor,
        likelihood: gpytorch.likelihoods.GaussianLikelihood,
        kernel: str | gpytorch.kernels.Kernel = "rbf",
        ard: bool = False,
        mean: str = "constant",
    ) -> None:
        super().__init__(train_x, train_y, likelihood)
        if mean == "constant":
            self.mean_module = gpytorch.means.ConstantMean()
        elif mean == "zero":
            self.mean_module = gpytorch.means.ZeroMean()
        else:
            raise ValueError(f"mean must be 'constant' or 'zero', got {mean!r}")
        if isinstance(kernel, str):
            kernel = make_kernel(kernel, ard_num_dims=train_x.shape[-1] if ard else None)
        self.covar_module = kernel

    def forward(self, x: torch.Tensor) -> gpytorch.distributions.MultivariateNormal:
        return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))


def hyperparameters(model: gpytorch.models.ExactGP) -> dict[str, float | list[float]]:
    """Constrained hyperparameters as plain numbers: lengthscale (list if ARD), outputscale, noise, mean.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.gp.training import ExactGPModel, hyperparameters
        >>> X = torch.rand(50, 2, dtype=torch.float64)
        >>> model = ExactGPModel(X, X.sum(-1), gpytorch.likelihoods.GaussianLikelihood()).double()
        >>> model.covar_module.base_kernel.lengthscale = 0.5
        >>> round(hyperparameters(model)["lengthscale"], 6)
        0.5
    """
    out: dict[str, float | list[float]] = {}
    kern = model.covar_module
    base = getattr(kern, "base_kernel", kern)
    ls = base.lengthscale.detach().reshape(-1)
    out["lengthscale"] = ls.tolist() if ls.numel() > 1 else float(ls)
    if hasattr(kern, "outputscale"):
        out["outputscale"] = float(kern.outputscale.detach())
    out["noise"] = float(model.likelihood.noise.detach().reshape(-1)[0])
    if hasattr(model.mean_module, "constant"):
        out["mean"] = float(model.mean_module.constant.detach().reshape(-1)[0])
    return out


@dataclass
class FitResult:
    """What a training run produced: ``loss_trace[t]`` = negative MLL per point at iteration t."""

    loss_trace: list[float] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    train_time_s: float = 0.0
    iterations: int = 0
    #: why training ended before ``iters``: ``"gradient at noise level"`` or ``"line search failed"``; else None
    stopped: str | None = None


#: the first bytes of a fit checkpoint: format tag, then the payload's CRC-32 and length, then the ``torch.save`` payload
CHECKPOINT_MAGIC = b"gpnys.fit/2\n"


def _fingerprint(model: torch.nn.Module, optimizer: str) -> dict[str, Any]:
    """What a checkpoint must match to resume: the training data (n, d, dtype and float64 sums of its values,
    rounded to 10 digits so that a move between devices still matches), the model's modules and parameter shapes,
    and the optimiser."""
    X, y = model.train_inputs[0], model.train_targets

    def summary(t: torch.Tensor) -> list[float]:
        v = t.detach().reshape(-1).to(torch.float64)
        w = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device).remainder(97.0) + 1.0
        return [float(f"{x:.10g}") for x in torch.stack([v.sum(), (v * w).sum(), v.square().sum()]).tolist()]

    return {"n": int(X.shape[-2]), "d": int(X.shape[-1]), "dtype": str(X.dtype), "inputs": summary(X),
            "targets": summary(y), "optimizer": optimizer,
            "modules": [f"{name}:{type(m).__name__}" for name, m in model.named_modules()],
            "parameters": {name: list(p.shape) for name, p in model.named_parameters()}}


def _stamp(payload: bytes) -> str:
    """``"crc32 length\\n"`` of a checkpoint's payload, 25 characters: a flipped bit or a truncation changes it."""
    return f"{zlib.crc32(payload):08x} {len(payload):015d}\n"


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """The state :func:`fit` wrote to a checkpoint file (``loss_trace``, ``steps``, ``model``, ``fingerprint``, ...),
    after checking its CRC-32 and length; ``ValueError`` naming the file if it is truncated, corrupt or not a
    checkpoint."""
    name = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    head = len(CHECKPOINT_MAGIC) + 25  # the tag, "crc32 length\n" as 8 + 1 + 15 + 1 characters
    if not raw.startswith(CHECKPOINT_MAGIC) or len(raw) < head:
        raise ValueError(f"checkpoint {name!r} is not a gpnys fit checkpoint ({len(raw)} bytes; empty, truncated, "
                         "another file or one from gpnys < 0.2): delete it to start afresh")
    stamp, payload = raw[len(CHECKPOINT_MAGIC) : head].decode("ascii", "replace"), raw[head:]
    if stamp != _stamp(payload):
        raise ValueError(f"checkpoint {name!r} is corrupt (its CRC-32 or length does not match its contents): delete "
                         "it to start afresh")
    try:
        # our own file, checksummed: model, optimiser and random states
        state = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
    except Exception as err:  # noqa: BLE001 (any unpickling failure is the same corrupt file to the caller)
        raise ValueError(f"checkpoint {name!r} cannot be read: {err}") from err
    if not isinstance(state, dict) or "fingerprint" not in state:
        raise ValueError(f"checkpoint {name!r} holds no gpnys fit state")
    return state


def _resume(path: str | os.PathLike, model: torch.nn.Module, opt: torch.optim.Optimizer, optimizer: str,
            result: FitResult, lr: float) -> float:
    """Load :func:`fit`'s checkpoint at ``path`` (if the file exists) into ``model``, ``opt`` and ``result``, and
    torch's random state; returns the elapsed step time it records (0 without a file). The checkpoint must come
    from this model, data and optimiser (a ``ValueError`` naming the file and the difference otherwise); the call's
    ``lr`` replaces the stored one."""
    if not os.path.exists(path):
        return 0.0
    state = read_checkpoint(path)
    expected = _fingerprint(model, optimizer)
    theirs = state["fingerprint"]
    if theirs.get("optimizer") != optimizer:
        raise ValueError(f"checkpoint {os.fspath(path)!r} is not a gpnys fit checkpoint for optimizer={optimizer!r} "
                         f"(it was written by optimizer={theirs.get('optimizer')!r})")
    diff = [key for key in expected if theirs.get(key) != expected[key]]
    if diff:  # another data set, size, dtype or model structure
        key = diff[0]
        raise ValueError(f"checkpoint {os.fspath(path)!r} does not match this model: its {key} is "
                         f"{theirs.get(key)!r}, this model's {expected[key]!r}")
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {os.fspath(path)!r} does not match this model: {err}") from err
    for group in opt.param_groups:  # the call's learning rate, not the one the checkpoint was written with
        group["lr"] = lr
    result.loss_trace[:], result.steps[:] = state["loss_trace"], state["steps"]
    torch.set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return float(state["elapsed_s"])


def _save_checkpoint(path: str | os.PathLike, model: torch.nn.Module, opt: torch.optim.Optimizer, optimizer: str,
                     result: FitResult, elapsed_s: float) -> None:
    """Write :func:`fit`'s checkpoint (its docstring) atomically, with its checksum: a crash mid-write keeps the
    previous one."""
    state = {"fingerprint": _fingerprint(model, optimizer), "model": model.state_dict(), "opt": opt.state_dict(),
             "loss_trace": list(result.loss_trace), "steps": list(result.steps), "elapsed_s": elapsed_s,
             "rng": torch.get_rng_state(),
             "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    payload = buffer.getvalue()
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        f.write(CHECKPOINT_MAGIC + _stamp(payload).encode("ascii") + payload)
    os.replace(tmp, path)


@contextlib.contextmanager
def exact_settings(n: int) -> Iterator[None]:
    """GPyTorch's exact path for ``n`` training points: Cholesky (``max_cholesky_size`` above n), no fast
    computations. :func:`fit`'s and :func:`predict`'s default ``settings``."""
    with gpytorch.settings.max_cholesky_size(n + 1), gpytorch.settings.fast_computations(False, False, False):
        yield


def fit(
    model: gpytorch.models.ExactGP,
    iters: int = 100,
    lr: float = 0.1,
    optimizer: str = "adam",
    progress: bool = True,
    seed: int = 0,
    settings: Callable[[int], contextlib.AbstractContextManager] | None = None,
    on_step: Callable[[int, float], dict[str, Any] | None] | None = None,
    loss: Callable[[gpytorch.models.ExactGP], torch.Tensor] | None = None,
    stop: Callable[[], bool] | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> FitResult:
    """Maximise the exact marginal likelihood of ``model`` (its likelihood attached) by Adam or L-BFGS.

    Args:
        model: an ``ExactGP`` with a ``GaussianLikelihood`` as ``model.likelihood``.
        iters: optimiser iterations (L-BFGS: one iteration with strong-Wolfe line search per step).
        lr: learning rate (Adam) or initial step (L-BFGS).
        optimizer: ``"adam"`` or ``"lbfgs"``.
        progress: show a tqdm progress bar with the current loss.
        seed: seeds torch's global generator so stochastic estimators are reproducible.
        settings: context-manager factory ``settings(n)`` wrapping every loss evaluation; default is the
            exact (Cholesky) path.
        on_step: called as ``on_step(t, loss)`` after every step; a returned dict is shown in the progress bar
            and appended to ``FitResult.steps``.
        loss: ``loss(model)`` returning ``-MLL / n`` to minimise instead of GPyTorch's
            ``-ExactMarginalLogLikelihood`` (e.g. :func:`gpnys.baselines.exact.cholesky_loss`); evaluated inside
            ``settings``.
        stop: called after every step (the parameters' ``.grad`` hold the last evaluation's gradient); ``True``
            ends training with ``FitResult.stopped = "gradient at noise level"`` (e.g.
            :func:`gpnys.gp.estimator.gradient_at_noise`).
        checkpoint: a file that makes a long fit resumable. After every step the model's and the optimiser's
            state, the loss trace, ``steps``, the elapsed step time and torch's random state are written there
            (``torch.save``, through a temporary file and a rename). If the file exists when ``fit`` starts, training
            resumes from it: ``iters`` counts every step, so ``iters - len(loss_trace)`` more are run, and the
            result (``train_time_s`` included) covers them all. The file carries a CRC-32 of its contents and a
            fingerprint of the model (data sums, n, d, dtype, modules, parameter shapes, optimiser): a corrupt
            file, or one from another model, data set or optimiser, raises ``ValueError`` naming the file and the
            difference. A resumed fit uses this call's ``lr``.

    L-BFGS stops cleanly at the first step whose line search makes no progress (the loss at the next step's start
    is not below this step's): the parameters go back to the best point, ``stopped = "line search failed"``. A
    stochastic estimate under common random numbers is deterministic but its gradient is not the derivative of
    its value, so a line search may fail near the optimum instead of converging.

    Returns:
        :class:`FitResult`.

    Example:
        Ten Adam steps on the exact (Cholesky) loss:

        >>> import gpytorch, torch
        >>> from gpnys.gp import ExactGPModel, fit
        >>> _ = torch.manual_seed(0)
        >>> X = torch.rand(100, 2, dtype=torch.float64)
        >>> y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(100, dtype=torch.float64)
        >>> model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
        >>> result = fit(model, iters=10, lr=0.1, progress=False)
        >>> result.iterations, result.loss_trace[-1] < result.loss_trace[0]
        (10, True)

        Under :func:`gpnys.gp.hook.use_preconditioner`, pass ``settings=lambda n: contextlib.nullcontext()`` so
        the hook's estimator, not the Cholesky path, computes the loss (docs/training.md).
    """
    validate_choice(optimizer, "optimizer", OPTIMIZERS)
    if isinstance(iters, bool) or int(iters) != iters or iters < 0:
        raise ValueError(f"iters must be a non-negative integer, got {iters!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be positive and finite, got {lr!r}")
    if checkpoint is not None and (not isinstance(checkpoint, (str, os.PathLike)) or os.path.isdir(checkpoint)):
        raise ValueError(f"checkpoint must be a file path, got {checkpoint!r}")
    validate_training_data(model.train_inputs[0], model.train_targets, ("train_inputs", "train_targets"))
    torch.manual_seed(seed)
    likelihood = model.likelihood
    model.train()
    likelihood.train()
    mll = gpytorch.mlls.ExactMarginalLogLikelihood(likelihood, model)
    params = [p for p in model.parameters() if p.requires_grad]
    n = model.train_inputs[0].shape[-2]
    ctx = settings or exact_settings
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(params, lr=lr)
    else:
        opt = torch.optim.LBFGS(params, lr=lr, max_iter=1, history_size=10, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        with ctx(n):
            value = loss(model) if loss is not None else -mll(model(*model.train_inputs), model.train_targets)
        value.backward()
        return value

    result = FitResult()
    previous_s = _resume(checkpoint, model, opt, optimizer, result, lr) if checkpoint is not None else 0.0
    start = time.perf_counter() - previous_s
    bar = tqdm(range(len(result.loss_trace), iters), desc="fit", disable=not progress, leave=True,
               initial=len(result.loss_trace), total=iters)
    starts: list[list[torch.Tensor]] = []  # L-BFGS: where the last two steps started
    for _ in bar:
        if optimizer == "lbfgs":
            starts = starts[-1:] + [[p.detach().clone() for p in params]]
        value = float(opt.step(closure).detach())  # the loss where this step started
        if optimizer == "lbfgs" and result.loss_trace and value >= result.loss_trace[-1]:
            with torch.no_grad():  # the previous step went uphill: back to where it started
                for p, b in zip(params, starts[0]):
                    p.copy_(b)
            result.stopped = "line search failed"
            break
        result.loss_trace.append(value)
        extra = on_step(len(result.loss_trace) - 1, value) if on_step is not None else None
        if extra:
            result.steps.append(extra)
        bar.set_postfix(loss=f"{value:.4f}", **(extra or {}))
        if checkpoint is not None:
            _save_checkpoint(checkpoint, model, opt, optimizer, result, time.perf_counter() - start)
        if stop is not None and stop():
            result.stopped = "gradient at noise level"
            break
    result.train_time_s = time.perf_counter() - start
    result.iterations = len(result.loss_trace)
    return result


def predict(
    model: gpytorch.models.ExactGP, test_x: torch.Tensor, settings: contextlib.AbstractContextManager | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictive mean and variance of ``y`` (noise included) at ``test_x (m, d)``. Returns ``((m,), (m,))``.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.gp import ExactGPModel, predict
        >>> _ = torch.manual_seed(0)
        >>> X = torch.rand(100, 1, dtype=torch.float64)
        >>> y = torch.sin(6 * X[:, 0]) + 0.1 * torch.randn(100, dtype=torch.float64)
        >>> model = ExactGPModel(X, y, gpytorch.likelihoods.GaussianLikelihood()).double()
        >>> model.covar_module.base_kernel.lengthscale, model.likelihood.noise = 0.3, 0.01
        >>> X_test = torch.linspace(0.1, 0.9, 20, dtype=torch.float64)[:, None]
        >>> mean, var = predict(model, X_test)
        >>> mean.shape, var.shape
        (torch.Size([20]), torch.Size([20]))
        >>> bool((mean - torch.sin(6 * X_test[:, 0])).abs().max() < 0.2)  # close to the noise-free function
        True
    """
    model.eval()  # left in eval mode, as GPyTorch predicts: its prediction cache is kept for the next call
    model.likelihood.eval()
    n = model.train_inputs[0].shape[-2]
    with torch.no_grad(), (settings or exact_settings(n)):
        pred = model.likelihood(model(test_x))
        return pred.mean, pred.variance


@contextlib.contextmanager
def eval_mode(model: gpytorch.models.ExactGP) -> Iterator[None]:
    """``model`` and its likelihood in eval mode within the block, and every submodule back in the mode it had
    after it (a prediction inside a training loop leaves the loop's next loss a training loss). Back in training,
    GPyTorch drops its prediction cache, as its ``train()`` does.

    Example:
        >>> import gpytorch, torch
        >>> from gpnys.gp import ExactGPModel
        >>> model = ExactGPModel(torch.rand(5, 1), torch.rand(5), gpytorch.likelihoods.GaussianLikelihood())
        >>> with eval_mode(model):
        ...     model.training, model.likelihood.training
        (False, False)
        >>> model.training, model.likelihood.training
        (True, True)
    """
    modes = {module: module.training for module in model.modules()}  # the likelihood is a submodule
    model.eval()
    try:
        yield
    finally:
        model.train(modes[model])  # GPyTorch's train() drops the prediction cache on the way back to training
        for module, flag in modes.items():  # each as it was (a feature extractor kept in eval mode stays there)
            module.training = flag


def gaussian_nll(y: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> float:
    """Mean negative log predictive density of ``y`` under independent ``N(mean, var)``.

    Example:
        >>> import math, torch
        >>> from gpnys.gp import gaussian_nll
        >>> nll = gaussian_nll(torch.zeros(4), torch.zeros(4), torch.ones(4))  # y at the mean, unit variance
        >>> abs(nll - 0.5 * math.log(2 * math.pi)) < 1e-7
        True
    """
    return float((0.5 * torch.log(2 * math.pi * var) + 0.5 * (y - mean).square() / var).mean())
