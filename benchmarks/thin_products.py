"""Thin products on this machine: ``A @ B`` for a symmetric ``n x n`` matrix ``A`` (a stored kernel) and ``t``
columns, timed in each of torch's forms (:data:`gpnys.linalg.TORCH_FORMS`) and split over threads through numpy's
BLAS (``"split"``: what every ``"split+..."`` form of :data:`gpnys.linalg.THIN_FORMS` does with a stored kernel of
at least :data:`gpnys.linalg.SPLIT_MIN_ROWS` rows),
with the form :func:`gpnys.linalg.time_thin_forms` picks on its calibration product.

Run:  python benchmarks/thin_products.py            (n = 8000, t = 2-20, 24, 32; float64 and float32; ~2 minutes
                                                    on 2 cores)
      python benchmarks/thin_products.py --quick    (n = 512, t = 2, 5, 17; the test suite)

Each cell is the fastest of ``--repeats`` runs after a warm-up, in milliseconds. A single column has no form to
choose (``thin_matmul`` runs it as a matrix-vector product), so ``t`` starts at 2. Prints a table per dtype, writes
``benchmarks/results/thin_products.json`` and a PNG of time against ``t``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

#: the columns of the table: torch's forms, and the split product every "split+..." form takes for a stored kernel
FORMS = ("direct", "transposed", "direct-padded", "transposed-padded", "split")


def sweep(n: int, columns: list[int], dtype, repeats: int) -> list[dict]:
    """One row per column count: each form's best time in ms and the fastest form."""
    import torch

    from gpnys.linalg import _split_product, thin_matmul

    g = torch.Generator().manual_seed(0)
    A = torch.rand(n, n, generator=g, dtype=dtype)
    A = (A + A.mT) / 2
    rows = []
    for t in columns:
        B = torch.rand(n, t, generator=g, dtype=dtype)
        row: dict = {"t": t}
        for form in FORMS:
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                if form == "split":  # at any n (thin_matmul splits from SPLIT_MIN_ROWS rows)
                    _split_product(A, B)
                else:
                    thin_matmul(A, B, form, symmetric=True)
                times.append(time.perf_counter() - t0)
            row[form] = 1e3 * min(times[1:])
        row["fastest"] = min(FORMS, key=row.__getitem__)
        rows.append(row)
    return rows


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(out["dtypes"]), figsize=(6 * len(out["dtypes"]), 4), squeeze=False)
    for ax, (name, rows) in zip(axes[0], out["dtypes"].items()):
        for form in FORMS:
            ax.plot([r["t"] for r in rows], [r[form] for r in rows], marker="o", label=form)
        ax.set(title=f"{name}, n = {out['n']}, chosen: {out['chosen'][name]}", xlabel="columns t", ylabel="ms")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    import torch

    from gpnys.baselines.provenance import provenance
    from gpnys.linalg import time_thin_forms

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--n", type=int, default=None, help="rows and columns of A (default 8000; quick 512)")
    ap.add_argument("--columns", default=None, help="comma-separated column counts, each >= 2 (default 2-20,24,32)")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per cell (default 3; quick 2)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    n = args.n or (512 if args.quick else 8000)
    columns = ([int(c) for c in args.columns.split(",")] if args.columns
               else [2, 5, 17] if args.quick else list(range(2, 21)) + [24, 32])
    repeats = args.repeats or (2 if args.quick else 3)
    if n < 1 or repeats < 1 or min(columns) < 2:
        raise SystemExit("--n and --repeats must be positive and every --columns entry at least 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtypes = {"float64": torch.float64, "float32": torch.float32}
    out: dict = {"n": n, "repeats": repeats, "threads": torch.get_num_threads(),
                 "provenance": provenance(__file__, argv, "cpu"), "dtypes": {}, "chosen": {}}
    for name, dtype in dtypes.items():
        out["chosen"][name] = time_thin_forms(dtype, "cpu")
        out["dtypes"][name] = sweep(n, columns, dtype, repeats)
    for name, rows in out["dtypes"].items():
        print(f"\n{name}, A {n} x {n}, {out['threads']} threads, ms (time_thin_forms picks {out['chosen'][name]})")
        print(f"{'t':>3} " + " ".join(f"{form:>18}" for form in FORMS) + "  fastest")
        for r in rows:
            print(f"{r['t']:3d} " + " ".join(f"{r[form]:18.2f}" for form in FORMS) + f"  {r['fastest']}")
    path = Path(args.out) if args.out else RESULTS / "thin_products.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    plot(out, path.with_suffix(".png"))
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
