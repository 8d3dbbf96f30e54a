"""Laplace GP classification: gpnys's preconditioned Laplace against a dense Cholesky Laplace and GPyTorch's
variational classifier.

Run:  python benchmarks/laplace.py --threads 2          (n = 5 000, a few minutes on 2 cores)
      python benchmarks/laplace.py --quick              (n = 300, seconds; run by the test suite)
      python benchmarks/laplace.py --threads 2 --n 14940 --test 1659 --no-dense
                                                        (every elevators row, no dense reference; ~15 minutes)

Data: the bundled UCI elevators set (``gpnys.datasets``, split 0), its target thresholded at the median training
target (label ``y > median``), ``--n`` seeded training rows and ``--test`` test rows, inputs standardised on the
training rows. Kernel: ``ScaleKernel(MaternKernel(nu=1.5))``, length-scale started at the median heuristic and
outputscale at 1.

1. **gpnys**: :class:`~gpnys.classify.LaplaceGPClassifier` trains the hyperparameters by ``--steps`` Adam steps on
   ``-log q / n`` (R&W 2006 §5.5.1, Algorithm 5.1, gradient by PCG + SLQ), then predicts. Time: training + the
   final fit + prediction.
2. **Dense reference** at gpnys's trained hyperparameters: R&W Algorithm 3.1 with a Cholesky factor of
   ``B = I + W^½ K W^½`` (float64): ``log q`` (eq. (3.32)) and Algorithm 5.1's gradient (``∂K/∂θ`` by central
   differences in the raw parameters, step 1e-5, relative error about 1e-10). Reported: gpnys's errors against it
   in units of its own standard errors, and both times for one ``log q``.
3. **GPyTorch's variational classifier** (SVGP: ``VariationalStrategy`` with ``--inducing`` inducing points from
   the training rows, ``BernoulliLikelihood``, ``VariationalELBO``, full-batch Adam lr 0.05): test accuracy
   against time every ``--svgp-every`` iterations, up to ``--svgp-iters``. Reported: the time at which it first
   reaches gpnys's test accuracy (``None``: never within its iterations).

Prints a table, writes ``results/laplace_<n>.json`` and ``results/laplace_<n>.png`` (test accuracy against time).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import gpytorch
import numpy as np
import torch

from gpnys import datasets
from gpnys.baselines.laplace import dense_laplace as dense_laplace_mode
from gpnys.baselines.provenance import provenance
from gpnys.classify import LaplaceGPClassifier
from gpnys.reduced.nystrom_features import median_lengthscale

RESULTS = Path(__file__).resolve().parent / "results"


def load(n: int, n_test: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data, mask = datasets.load_array("elevators")
    test = mask[:, 0]
    X, t = data[:, :-1], data[:, -1]
    rng = np.random.default_rng(seed)
    tr = rng.permutation(np.flatnonzero(~test))[:n]
    te = rng.permutation(np.flatnonzero(test))[:n_test]
    thr = np.median(t[tr])
    mu, sd = X[tr].mean(0), X[tr].std(0)
    sd[sd == 0] = 1.0
    f64 = torch.float64
    return (torch.as_tensor((X[tr] - mu) / sd, dtype=f64), torch.as_tensor(t[tr] > thr, dtype=f64),
            torch.as_tensor((X[te] - mu) / sd, dtype=f64), torch.as_tensor(t[te] > thr, dtype=f64))


def make_kernel(lengthscale: float) -> gpytorch.kernels.Kernel:
    k = gpytorch.kernels.ScaleKernel(gpytorch.kernels.MaternKernel(nu=1.5)).double()
    k.base_kernel.lengthscale, k.outputscale = lengthscale, 1.0
    return k


def dense_laplace(X: torch.Tensor, y: torch.Tensor, kernel: gpytorch.kernels.Kernel) -> dict:
    """R&W Algorithm 3.1 (Cholesky of B) and Algorithm 5.1 at ``kernel``'s hyperparameters: log q and its gradient
    per raw parameter name (``∂K/∂θ`` by central differences)."""
    with torch.no_grad():
        K = kernel(X).to_dense()
        ref = dense_laplace_mode(K, y)
        pi = torch.sigmoid(ref.f)
        sW, g, mll = ref.W.sqrt(), ref.a, float(ref.log_q)
        R = sW[:, None] * torch.cholesky_inverse(ref.L) * sW  # (K + W⁻¹)⁻¹
        KR = K @ R
        sigma_diag = K.diagonal() - (KR * K).sum(1)  # diag(K - K R K) = diag((K⁻¹ + W)⁻¹)
        s2 = 0.5 * sigma_diag * (-pi * (1 - pi) * (1 - 2 * pi))  # ∂ log q / ∂f̂ (∂W/∂f = -∇³ log p)
        grad = {}
        h = 1e-5
        for name, p in kernel.named_parameters():
            flat = p.data.reshape(-1)
            out = torch.empty_like(flat)
            for i in range(flat.numel()):
                old = float(flat[i])
                flat[i] = old + h
                Kp = kernel(X).to_dense()
                flat[i] = old - h
                Km = kernel(X).to_dense()
                flat[i] = old
                C = (Kp - Km) / (2 * h)
                b = C @ g
                out[i] = 0.5 * g @ C @ g - 0.5 * (R * C).sum() + s2 @ (b - KR @ b)
            grad[name] = out.reshape(p.shape)
    return {"log_q": mll, "gradient": grad}


def against_dense(clf: LaplaceGPClassifier, ref: dict | None, seconds: float | None, n: int) -> dict:
    """The JSON's comparison fields: gpnys's ``log q`` and gradient against the dense reference ``ref``, in units of
    gpnys's standard errors (every dense field ``None`` without a reference)."""
    grads = {name: {"gpnys": clf.mll_gradient_[name].reshape(-1).tolist(),
                    "std_error": clf.mll_gradient_std_error_[name].reshape(-1).tolist(),
                    "dense": None if ref is None else ref["gradient"][name].reshape(-1).tolist()}
             for name in clf.mll_gradient_}
    if ref is None:
        return {"dense": None, "log_q_error_per_point": None, "log_q_error_in_std_errors": None, "gradient": grads,
                "gradient_errors_in_std_errors_max": None}
    err = abs(clf.log_marginal_likelihood_ - ref["log_q"])
    z = [abs(g - d) / s for v in grads.values() for g, d, s in zip(v["gpnys"], v["dense"], v["std_error"])]
    return {"dense": {"log_q": ref["log_q"], "seconds": seconds}, "log_q_error_per_point": err / n,
            "log_q_error_in_std_errors": err / max(clf.mll_std_error_, 1e-300), "gradient": grads,
            "gradient_errors_in_std_errors_max": max(z)}


def svgp(Xtr, ytr, Xte, yte, lengthscale: float, inducing: int, iters: int, every: int, seed: int,
         batch: int | None = None, lr: float = 0.05) -> list[dict]:
    """GPyTorch's variational classifier: ``(seconds, test accuracy)`` every ``every`` iterations. ``batch``: rows
    per iteration, drawn as seeded epochs of a permutation (GPyTorch's minibatch recipe); ``None``: every row."""
    torch.manual_seed(seed)
    Z = Xtr[torch.randperm(Xtr.shape[0])[:inducing]].clone()
    n = Xtr.shape[0]
    batches = torch.Generator().manual_seed(seed)  # its own stream: the model's initialisation draws as before
    order = torch.randperm(n, generator=batches)
    at = 0

    class Model(gpytorch.models.ApproximateGP):
        def __init__(self):
            dist = gpytorch.variational.CholeskyVariationalDistribution(Z.shape[0])
            strat = gpytorch.variational.VariationalStrategy(self, Z, dist, learn_inducing_locations=True)
            super().__init__(strat)
            self.mean_module = gpytorch.means.ZeroMean()
            self.covar_module = make_kernel(lengthscale)

        def forward(self, x):
            return gpytorch.distributions.MultivariateNormal(self.mean_module(x), self.covar_module(x))

    model, lik = Model().double(), gpytorch.likelihoods.BernoulliLikelihood().double()
    mll = gpytorch.mlls.VariationalELBO(lik, model, num_data=ytr.numel())
    opt = torch.optim.Adam([*model.parameters(), *lik.parameters()], lr=lr)
    rows, elapsed = [], 0.0
    for it in range(1, iters + 1):
        model.train(), lik.train()
        t0 = time.perf_counter()
        if batch is None or batch >= n:
            rows_x, rows_y = Xtr, ytr
        else:
            if at + batch > n:
                order, at = torch.randperm(n, generator=batches), 0
            idx = order[at : at + batch]
            at += batch
            rows_x, rows_y = Xtr[idx], ytr[idx]
        opt.zero_grad()
        loss = -mll(model(rows_x), rows_y)
        loss.backward()
        opt.step()
        elapsed += time.perf_counter() - t0
        if it % every == 0 or it == iters:
            model.eval(), lik.eval()
            t0 = time.perf_counter()
            with torch.no_grad():
                p = lik(model(Xte)).mean
            elapsed += time.perf_counter() - t0
            rows.append({"iteration": it, "seconds": elapsed, "accuracy": float(((p > 0.5).double() == yte).double()
                                                                                     .mean())})
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=5000)
    ap.add_argument("--test", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=10, help="gpnys's Adam steps on the hyperparameters")
    ap.add_argument("--k", type=int, default=500, help="AFN landmarks")
    ap.add_argument("--probes", type=int, default=32)
    ap.add_argument("--inducing", type=int, default=500)
    ap.add_argument("--svgp-iters", type=int, default=300)
    ap.add_argument("--svgp-every", type=int, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-dense", action="store_true",
                    help="skip the dense reference (its gradient costs O(n^3) and several n x n matrices)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.n, args.test, args.steps, args.k, args.inducing, args.svgp_iters, args.svgp_every = 300, 200, 3, 100, 50, \
            40, 20
    if args.threads:
        torch.set_num_threads(args.threads)
    record = provenance(__file__, argv)
    Xtr, ytr, Xte, yte = load(args.n, args.test, args.seed)
    ell = median_lengthscale(Xtr)

    kernel = make_kernel(ell)
    t0 = time.perf_counter()
    clf = LaplaceGPClassifier(kernel, precond_options={"k": args.k}, num_probes=args.probes, seed=args.seed,
                              optimizer_steps=args.steps, lr=0.1).fit(Xtr, ytr)
    acc = float((clf.predict(Xte).double() == yte).double().mean())
    t_gpnys = time.perf_counter() - t0
    t0 = time.perf_counter()
    trained = clf.kernel_  # the trained hyperparameters (kernel is left as it was)
    LaplaceGPClassifier(trained, precond_options={"k": args.k}, num_probes=args.probes, seed=args.seed).fit(Xtr, ytr)
    t_one = time.perf_counter() - t0  # one log q + gradient at the trained hyperparameters

    t0 = time.perf_counter()
    ref = None if args.no_dense else dense_laplace(Xtr, ytr, trained)
    t_dense = None if ref is None else time.perf_counter() - t0
    comparison = against_dense(clf, ref, t_dense, args.n)

    rows = svgp(Xtr, ytr, Xte, yte, ell, args.inducing, args.svgp_iters, args.svgp_every, args.seed)
    reached = next((r["seconds"] for r in rows if r["accuracy"] >= acc), None)

    out = {"n": args.n, "test": args.test, "steps": args.steps, "k": args.k, "probes": args.probes,
           "threads": torch.get_num_threads(), "provenance": record,
           "gpnys": {"seconds": t_gpnys, "test_accuracy": acc, "log_q": clf.log_marginal_likelihood_,
                     "log_q_std_error": clf.mll_std_error_, "one_log_q_and_gradient_s": t_one,
                     "history": clf.history_,
                     "hyperparameters": {"lengthscale": float(clf.kernel_.base_kernel.lengthscale.detach()),
                                         "outputscale": float(clf.kernel_.outputscale.detach())}},
           **comparison,
           "svgp": {"inducing": args.inducing, "rows": rows, "seconds_to_gpnys_accuracy": reached}}
    print(f"elevators (y > median), n = {args.n}, Matérn-3/2, gpnys {args.steps} Adam steps, AFN k = {args.k}")
    print(f"{'method':<28}{'seconds':>10}{'test acc':>10}{'log q':>14}")
    print(f"{'gpnys Laplace (train+pred)':<28}{t_gpnys:10.2f}{acc:10.4f}{clf.log_marginal_likelihood_:14.4f}"
          f" ± {clf.mll_std_error_:.2g}")
    if ref is not None:
        print(f"{'dense Laplace (one log q)':<28}{t_dense:10.2f}{'':>10}{ref['log_q']:14.4f}")
    print(f"{'gpnys (one log q + grad)':<28}{t_one:10.2f}")
    for r in rows[-1:]:
        print(f"{'GPyTorch SVGP, m = ' + str(args.inducing):<28}{r['seconds']:10.2f}{r['accuracy']:10.4f}"
              f"   ({r['iteration']} iterations)")
    if ref is not None:
        print(f"log q error: {out['log_q_error_per_point']:.2e} per point ({out['log_q_error_in_std_errors']:.2f} "
              f"standard errors); gradient errors at most {out['gradient_errors_in_std_errors_max']:.2f} standard "
              f"errors")
    print(f"SVGP reached gpnys's accuracy at {reached if reached is None else round(reached, 2)} s")
    path = Path(args.out) if args.out else RESULTS / f"laplace_{args.n}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["seconds"] for r in rows], [r["accuracy"] for r in rows], "o-", label="GPyTorch SVGP")
        ax.plot([t_gpnys], [acc], "s", color="C3", label="gpnys Laplace")
        ax.set_xlabel("seconds (train + predict)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"elevators, n = {args.n}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120)
        plt.close(fig)
    except ImportError:
        pass
    return out


if __name__ == "__main__":
    main()
