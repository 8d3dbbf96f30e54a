"""Exact GP regression with GPyTorch: the model, a training loop (Adam or L-BFGS) with checkpoints, prediction and
metrics.

By default :func:`fit` and :func:`predict` force GPyTorch's Cholesky path (``max_cholesky_size`` above n), so loss and
gradients are exact; under :func:`gpnys.gp.hook.use_preconditioner` the hook computes every evaluation on the path it
chooses (``EstimatorSettings.solver``), whatever ``settings`` says.
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

from gpnys.checks import validate_choice, validate_test_points, validate_training_data
from gpnys.kernels import make_kernel

__all__ = ["ExactGPModel", "FitResult", "fit", "predict", "gaussian_nll", "hyperparameters", "read_checkpoint",
           "exact_settings", "OPTIMIZERS"]

OPTIMIZERS = ("adam", "lbfgs")
#: the most loss evaluations an L-BFGS step's strong-Wolfe line search may spend (torch's ``max_ls`` default)
LINE_SEARCH_EVALUATIONS = 25


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


#: the first bytes of a fit checkpoint: format tag, then the payload's CRC-32 and length, then the
#: ``torch.save`` payload
CHECKPOINT_MAGIC = b"gpnys.fit/2\n"


#: the seed of :func:`_sums`' weights
SUMS_SEED = 20261201


def _sums(t: torch.Tensor) -> list[float]:
    """Float64 sum, weighted sum and sum of squares of ``t``'s values, rounded to 10 digits (a move between devices
    still matches). The weights are fixed draws from ``[1, 2)``, one per position, so that a permutation of the
    values changes the weighted sum (position weights that repeat would miss swaps a period apart)."""
    v = t.detach().reshape(-1).to(torch.float64)
    gen = torch.Generator().manual_seed(SUMS_SEED)
    w = (1.0 + torch.rand(v.numel(), generator=gen, dtype=torch.float64)).to(v.device)
    return [float(f"{x:.10g}") for x in torch.stack([v.sum(), (v * w).sum(), v.square().sum()]).tolist()]


def _values(t: torch.Tensor) -> list[float] | dict[str, list]:
    """A tensor as a checkpoint records it: its values (10 digits) when it has at most 8, else its shape and sums."""
    if t.numel() <= 8:
        return [float(f"{x:.10g}") for x in t.detach().reshape(-1).to(torch.float64).tolist()]
    return {"shape": list(t.shape), "sums": _sums(t)}


def _configuration(model: torch.nn.Module) -> dict[str, Any]:
    """What changes the loss without being trained, by dotted name: every module's buffers (a constraint's bounds, a
    prior's parameters, a kernel's ``active_dims``), its frozen parameters and its public plain attributes (a
    Matern's ``nu``, ``ard_num_dims``, a batch shape); ``None`` and other objects (a prediction cache) are left out."""
    plain = (bool, int, float, str)
    out: dict[str, Any] = {}
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        for key, value in vars(module).items():
            sequence = isinstance(value, (tuple, list)) and all(isinstance(v, plain) for v in value)  # a torch.Size
            if not key.startswith("_") and key != "training" and (sequence or isinstance(value, plain)):
                out[prefix + key] = list(value) if sequence else value
        untrained = [*module.named_buffers(recurse=False),
                     *((key, p) for key, p in module.named_parameters(recurse=False) if not p.requires_grad)]
        out.update({prefix + key: _values(t) for key, t in untrained})
    return out


#: the fingerprint's format: a checkpoint of another records no ``format`` or another value
FINGERPRINT_FORMAT = 2


def _fingerprint(model: torch.nn.Module, optimizer: str) -> dict[str, Any]:
    """What a checkpoint must match to resume: the training data (n, d, dtype and :func:`_sums` of every training
    input and the targets), the model's modules, parameter shapes and :func:`_configuration`, and the optimiser."""
    X, y = model.train_inputs[0], model.train_targets
    return {"format": FINGERPRINT_FORMAT, "n": int(X.shape[-2]), "d": int(X.shape[-1]), "dtype": str(X.dtype),
            "inputs": [_sums(t) for t in model.train_inputs], "outputs": _sums(y), "optimizer": optimizer,
            "modules": {name: type(m).__name__ for name, m in model.named_modules()},
            "parameters": {name: list(p.shape) for name, p in model.named_parameters()},
            "configuration": _configuration(model)}


def _difference(theirs: dict[str, Any], ours: dict[str, Any]) -> str | None:
    """Where a checkpoint's fingerprint differs from this model's, in words (the first key that differs; of a table,
    each entry that differs); ``None`` if nowhere."""
    missing = [key for key in ours if key not in theirs]
    if missing:
        return f"it records no {missing[0]} (written by an older gpnys)"
    for key, value in ours.items():
        other = theirs[key]
        if other == value:
            continue
        if isinstance(value, dict) and isinstance(other, dict):  # name the entries, not the whole table
            subs = [k for k in dict.fromkeys([*value, *other]) if value.get(k, ...) != other.get(k, ...)]
            return "; ".join(f"its {key}[{sub!r}] is {other.get(sub, '(absent)')!r}, this model's "
                             f"{value.get(sub, '(absent)')!r}" for sub in subs)
        return f"its {key} is {other!r}, this model's {value!r}"
    return None


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


def _resume(path: str | os.PathLike, fingerprint: dict[str, Any], model: torch.nn.Module, opt: torch.optim.Optimizer,
            result: FitResult, iters: int) -> tuple[float, list[torch.Tensor] | None]:
    """Load :func:`fit`'s checkpoint at ``path`` (if the file exists) into ``model``, ``opt`` and ``result``, and
    torch's random state. Returns the elapsed step time it records and, for L-BFGS, where its last step started
    (``(0.0, None)`` without a file). The checkpoint must have been written for ``fingerprint`` (this model, data and
    optimiser, before training) and hold at most ``iters`` steps (a ``ValueError`` naming the file and the
    difference otherwise); ``opt``'s settings (``lr`` included) stay this call's."""
    if not os.path.exists(path):
        return 0.0, None
    name = os.fspath(path)
    state = read_checkpoint(path)
    theirs, optimizer = state["fingerprint"], fingerprint["optimizer"]
    if theirs.get("optimizer") != optimizer:
        raise ValueError(f"checkpoint {name!r} is not a gpnys fit checkpoint for optimizer={optimizer!r} "
                         f"(it was written by optimizer={theirs.get('optimizer')!r})")
    difference = _difference(theirs, fingerprint)
    if difference:  # another data set, size, dtype, model structure or configuration
        raise ValueError(f"checkpoint {name!r} does not match this model: {difference}; delete it to start afresh")
    done = len(state["loss_trace"])
    if iters < done:
        raise ValueError(f"iters={iters} is below the {done} steps checkpoint {name!r} holds (iters counts every "
                         f"step, the resumed ones included): pass iters >= {done}, or delete the file to start afresh")
    own = [{k: v for k, v in group.items() if k != "params"} for group in opt.param_groups]
    try:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
    except (RuntimeError, ValueError, KeyError) as err:
        raise ValueError(f"checkpoint {name!r} does not match this model: {err}") from err
    for group, hyper in zip(opt.param_groups, own):  # this call's lr (and max_eval, ...), not the stored ones
        group.update(hyper)
    result.loss_trace[:], result.steps[:] = state["loss_trace"], state["steps"]
    result.stopped = state["stopped"]
    torch.set_rng_state(state["rng"])
    if state.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return float(state["elapsed_s"]), state["step_start"]


def _save_checkpoint(path: str | os.PathLike, fingerprint: dict[str, Any], model: torch.nn.Module,
                     opt: torch.optim.Optimizer, result: FitResult, elapsed_s: float,
                     step_start: list[torch.Tensor] | None) -> None:
    """Write :func:`fit`'s checkpoint (its docstring) atomically, with its checksum: a crash mid-write keeps the
    previous one. ``fingerprint``: the model's before training (a buffer that training moves, a batch norm's running
    mean, is the same at every resume); ``step_start``: where the last L-BFGS step started (its parameters go back
    there if the next step's line search fails), else ``None``."""
    state = {"fingerprint": fingerprint, "model": model.state_dict(), "opt": opt.state_dict(),
             "loss_trace": list(result.loss_trace), "steps": list(result.steps), "stopped": result.stopped,
             "step_start": step_start, "elapsed_s": elapsed_s, "rng": torch.get_rng_state(),
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
        iters: optimiser iterations (L-BFGS: one iteration per step, its strong-Wolfe line search spending up to
            :data:`LINE_SEARCH_EVALUATIONS` loss evaluations).
        lr: learning rate (Adam) or initial step (L-BFGS).
        optimizer: ``"adam"`` or ``"lbfgs"``.
        progress: show a tqdm progress bar with the current loss.
        seed: seeds torch's global generator so stochastic estimators are reproducible.
        settings: context-manager factory ``settings(n)`` wrapping every loss evaluation; default is the
            exact (Cholesky) path. Under :func:`~gpnys.gp.hook.use_preconditioner` the hook's path choice
            (``EstimatorSettings.solver``) decides instead.
        on_step: called as ``on_step(t, loss)`` after every step; a returned dict is shown in the progress bar
            and appended to ``FitResult.steps``.
        loss: ``loss(model)`` returning ``-MLL / n`` to minimise instead of GPyTorch's
            ``-ExactMarginalLogLikelihood`` (e.g. :func:`gpnys.baselines.exact.cholesky_loss`); evaluated inside
            ``settings``.
        stop: called after every step (the parameters' ``.grad`` hold the last evaluation's gradient; after an
            L-BFGS step, at the point it kept: evaluated once more if its line search ended elsewhere); ``True``
            ends training with ``FitResult.stopped = "gradient at noise level"`` (e.g.
            :func:`gpnys.gp.estimator.gradient_at_noise`).
        checkpoint: a file that makes a long fit resumable. After every step the model's and the optimiser's
            state, the loss trace, ``steps``, the elapsed step time and torch's random state are written there
            (``torch.save``, through a temporary file and a rename). If the file exists when ``fit`` starts, training
            resumes from it: ``iters`` counts every step, so ``iters - len(loss_trace)`` more are run, and the
            result (``train_time_s`` included) covers them all; ``iters`` below the steps it holds is a
            ``ValueError``. A run that stopped early (``stopped`` is saved too) is finished: a rerun returns its
            result without further steps. The file carries a CRC-32 of its contents and a fingerprint of the model
            as built (data sums, n, d, dtype, modules, parameter shapes, the optimiser, and what changes the loss
            without being trained: buffers such as constraint bounds and prior parameters, frozen parameters, plain
            attributes such as a Matern's ``nu``): a corrupt file, or one from another model, data set or
            optimiser, raises ``ValueError`` naming the file and the difference. A resumed fit uses this call's
            ``lr``. The file's directory must exist (``ValueError`` before any step).

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
    if checkpoint is not None:
        if not isinstance(checkpoint, (str, os.PathLike)) or not os.fspath(checkpoint) or os.path.isdir(checkpoint):
            raise ValueError(f"checkpoint must be a file path, got {checkpoint!r}")
        folder = os.path.dirname(os.path.abspath(checkpoint))
        if not os.path.isdir(folder):  # here, not at the first write after a step
            raise ValueError(f"checkpoint {os.fspath(checkpoint)!r}: its directory {folder!r} does not exist")
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
        # one iteration per step; max_eval: 1 evaluation where the step starts + the strong-Wolfe search's own
        # default of up to 25 trials. Torch's default, max_iter * 5 // 4 = 1, leaves the search no trial beyond the
        # first: an uphill first trial returns a zero step, and the run ends with "line search failed".
        opt = torch.optim.LBFGS(params, lr=lr, max_iter=1, max_eval=1 + LINE_SEARCH_EVALUATIONS, history_size=10,
                                line_search_fn="strong_wolfe")

    evaluated: list[torch.Tensor] = []  # L-BFGS with a stop test: the parameters at the last evaluation

    def closure() -> torch.Tensor:
        if optimizer == "lbfgs" and stop is not None:
            evaluated[:] = [p.detach().clone() for p in params]
        opt.zero_grad()
        with ctx(n):
            value = loss(model) if loss is not None else -mll(model(*model.train_inputs), model.train_targets)
        value.backward()
        return value

    result = FitResult()
    # the model as built: before the checkpoint's state, or a step, moves it
    fingerprint = _fingerprint(model, optimizer) if checkpoint is not None else {}
    previous_s, step_start = (0.0, None) if checkpoint is None else _resume(checkpoint, fingerprint, model, opt,
                                                                             result, iters)
    start = time.perf_counter() - previous_s
    done = len(result.loss_trace)
    bar = tqdm(range(done, done if result.stopped else iters), desc="fit", disable=not progress, leave=True,
               initial=done, total=iters)  # a run that stopped early is finished: no further steps
    starts = [step_start] if step_start is not None else []  # L-BFGS: where the last two steps started
    for _ in bar:
        if optimizer == "lbfgs":
            starts = starts[-1:] + [[p.detach().clone() for p in params]]
        value = float(opt.step(closure).detach())  # the loss where this step started
        if optimizer == "lbfgs" and result.loss_trace and value >= result.loss_trace[-1]:
            with torch.no_grad():  # the previous step went uphill: back to where it started
                for p, b in zip(params, starts[0]):
                    p.copy_(b.to(p))
            result.stopped = "line search failed"
        else:
            result.loss_trace.append(value)
            extra = on_step(len(result.loss_trace) - 1, value) if on_step is not None else None
            if extra:
                result.steps.append(extra)
            bar.set_postfix(loss=f"{value:.4f}", **(extra or {}))
            if stop is not None:
                if evaluated and not all(map(torch.equal, params, evaluated)):
                    closure()  # the line search's last evaluation was at a point it did not keep: stop() reads .grad
                if stop():
                    result.stopped = "gradient at noise level"
        if checkpoint is not None:  # after the stop decisions, so that a rerun of a finished run ends alike
            _save_checkpoint(checkpoint, fingerprint, model, opt, result, time.perf_counter() - start,
                             starts[-1] if starts else None)
        if result.stopped:
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
    test_x = validate_test_points(test_x, model.train_inputs[0])
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
