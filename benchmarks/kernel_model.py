"""A static throughput model of the Triton kernels on an H100 (sm_90), from their compiled instructions; no GPU.

Run:  python benchmarks/kernel_model.py --before 3479e1d     (~10 s to a minute: ~20 compilations)
      python benchmarks/kernel_model.py --quick              (this tree's product kernel only; the test suite)

Triton compiles each kernel for sm_90 (TTIR -> PTX -> cubin with the ptxas it ships), ``nvdisasm`` lists the SASS,
and the script counts the instructions one thread issues per ``64 x 64`` tile: the column-block loop's body, each
loop nested in it weighted by its trip count (the loops over the dimensions or column chunks). The tiles are
issue-bound -- the FP32 ``tl.dot``'s FFMAs and the elementwise work share the FMA pipe, one warp instruction per
scheduler and cycle -- so a tile's time is taken proportional to its instruction count, which holds only while
nothing spills: the ``spills`` column counts the kernel's stores to local memory (before / after; the calibration
kernel itself has 4, all outside its loop). Calibration: the H100's measured product, Matérn-3/2, d = 3, 32
columns, float32 (3.41e11 entries/s at n = 10^6 with the kernels of commit 62efdbb,
``gpu_h100_product_specialised.json``); check: the same with TF32, measured 5.80e11 entries/s.

Then one MLL value + gradient at n = 10^6 (every pair, error bars on: ``--cg-iterations`` products of 17 columns
and one per-probe pass of 17 columns with two planes (isotropic), plus the measured setup; the code of commit
000f71c, measured at 48.6 s on an H100, had one more derivative pass of one column, which the model adds for its
check against that measurement) for the baseline revision and this tree, and the cost model of
``benchmarks/distributed.py`` at 10^7 points on 8 GPUs.

This predicts; it does not measure. The GPU run that checks it is ``PARTS=kernels`` of
``benchmarks/gpu_check.sh``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

if __name__ == "__main__":  # compile for real (the test suite sets the interpreter; it runs this in a child)
    os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from gpnys.baselines.provenance import provenance  # noqa: E402
from gpnys.kernels.backends.triton_fused import BLOCK, TritonBackend, _pow2  # noqa: E402
from gpnys.kernels.formulas import formula  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KERNELS = "gpnys/kernels/backends/triton_kernels.py"
MEASURED = {"kv_t32_entries_per_s": 3.41e11, "kv_t32_tf32_entries_per_s": 5.80e11, "mll_1e6_s": 48.6,
            "setup_1e6_s": 1.51, "cg_iterations_1e6": 11}
SPEC = dict(MEASURED=MEASURED,
            source="benchmarks/RESULTS.md: H100 runs of the product (commit 62efdbb) and the MLL at 10^6 (000f71c)")


def load_kernels(rev: str | None):
    """The kernels module of revision ``rev`` (``git show``), or of this tree."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kernel_model.py compiles the kernels: run it without TRITON_INTERPRET")
    if rev is None:
        from gpnys.kernels.backends import triton_kernels

        return triton_kernels
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{KERNELS}"], capture_output=True, text=True,
                          check=True).stdout
    path = Path(tempfile.mkdtemp()) / f"kernels_{rev}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def sass(fn, consts: dict, dtype: torch.dtype, arch: int = 90) -> str:
    """The SASS of ``fn`` compiled for ``sm_<arch>`` with ``consts`` (the other arguments typed by name)."""
    fp = "*fp32" if dtype == torch.float32 else "*fp64"
    sig = {}
    for a in fn.arg_names:
        if a in consts:
            sig[a] = "constexpr"
        elif a in ("ptr", "idx"):
            sig[a] = "*i64"
        elif a in ("S_OUT", "G_OUT") or (a == "OUT" and fn.__name__ != "kv_kernel"):
            sig[a] = "*fp64"
        elif a in ("Z", "ZT", "U", "V", "OUT"):
            sig[a] = fp
        else:
            sig[a] = "i32"
    src = ASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    ck = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(ck.asm["cubin"])
        f.flush()
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout


def per_tile(text: str, trips: list[int]) -> int:
    """Instructions one thread issues per iteration of the outermost loop(s); the loops nested in them count
    ``trips[k]`` times each (in the order they appear)."""
    labels, ins = {}, []
    for line in text.splitlines():
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)\S*(.*)", line)
        if m:
            target = re.search(r"`\((\.L_x_\d+)\)", m.group(2))
            ins.append((m.group(1), target.group(1) if target else None))
    loops = sorted((labels[t], i) for i, (op, t) in enumerate(ins) if op == "BRA" and t and labels[t] < i)
    outer = [lp for lp in loops if not any(o != lp and o[0] <= lp[0] and lp[1] <= o[1] for o in loops)]
    total = 0
    for a, b in outer:
        weight = [1] * (b - a + 1)
        inner = [lp for lp in loops if lp not in outer and a <= lp[0] and lp[1] <= b]
        for k, (x, y) in enumerate(inner):
            for j in range(x, y + 1):
                weight[j - a] *= trips[min(k, len(trips) - 1)] if trips else 1
        total += sum(weight)
    return total


def case_constants(mod, kind: str, t: int, d: int, iso: bool, tf32: bool,
                   dtype: torch.dtype = torch.float32) -> tuple[dict, list[int], int]:
    """A kernel's compile-time constants for ``t`` columns in ``d`` dimensions, as its revision's backend would
    choose them, the trip counts of its nested loops, and the programs per tile (the per-probe planes)."""
    fn = getattr(mod, f"{kind}_kernel")
    new = "TAIL" in fn.arg_names
    hi = 32 if kind == "derivative" else 64
    bt, tail = TritonBackend._columns(t, hi, dtype) if new else (_pow2(t, 16, hi), 0)
    consts = dict(SPARSE=False, BLOCK=BLOCK, BT=bt, **TritonBackend(formula(1.5), tf32)._constants(dtype))
    if new:
        consts.update(TritonBackend._coords(torch.zeros(1, d, dtype=dtype))[1], TAIL=tail)
    if kind == "derivative":
        consts["DP"] = _pow2(d, 1, 1 << 30)
    if kind == "column":
        consts["ISO"] = iso
    chunks = -(-(t - tail) // bt)
    if new:  # unless the dimensions are unrolled (HOIST), the distances and the derivative's sums loop over them
        dims = [] if consts["HOIST"] else [d]
        trips = ([chunks] + dims + ([] if consts["HOIST"] else [d])) if kind == "derivative" else dims
    else:
        trips = [chunks, d, d] if kind == "derivative" else [d]
    programs = (2 if iso else 1 + d) if kind == "column" else 1
    return consts, trips, programs


CASES = [  # (label, kernel, columns, isotropic, tf32)
    ("product, 32 columns", "kv", 32, True, False),
    ("product, 32 columns, TF32", "kv", 32, True, True),
    ("product, 17 columns (CG)", "kv", 17, True, False),
    ("per-probe sums, 17 columns, 2 planes", "column", 17, True, False),
    ("derivative sums, 17 columns", "derivative", 17, True, False),
    ("derivative sums, 1 column", "derivative", 1, True, False),
]


def model(args) -> dict:
    """Instructions and spills per case and revision, the modelled entries/s (d = 3) and :func:`mll_model`."""
    revs = ([("before", args.before)] if args.before else []) + [("after", None)]
    mods = {tag: load_kernels(rev) for tag, rev in revs}
    cases = CASES[2:3] if args.quick else CASES
    rows = []
    for label, kind, t, iso, tf32 in cases:
        row = {"case": label, "kernel": kind, "columns": t, "d": args.d}
        for tag, _ in revs:
            mod = mods[tag]
            consts, trips, programs = case_constants(mod, kind, t, args.d, iso, tf32)
            text = sass(getattr(mod, f"{kind}_kernel"), consts, torch.float32)
            row[f"{tag}_instructions"] = programs * per_tile(text, trips)
            row[f"{tag}_spill_stores"] = len(re.findall(r"\bSTL\b", text))  # registers spilled to local memory
        rows.append(row)
    base = next((r for r in rows if r["case"] == CASES[0][0]), None)
    # the calibration is the d = 3 measurement: other d give instruction ratios only
    ref = base["before_instructions"] if base and args.before and args.d == 3 else None
    for r in rows:
        for tag, _ in revs:
            if ref:  # entries/s: the measured product scaled by instructions per tile
                r[f"{tag}_entries_per_s"] = MEASURED["kv_t32_entries_per_s"] * ref / r[f"{tag}_instructions"]
        if args.before:
            r["ratio"] = r["after_instructions"] / r["before_instructions"]
    out = {"meta": {"arch": "sm_90", "before": args.before, "d": args.d, **SPEC}, "kernels": rows}
    if ref:
        out["mll"] = mll_model(rows, args)
    return out


def mll_model(rows: list[dict], args) -> dict:
    """One value + gradient at 10^6 and at 10^7 on 8 GPUs (module docstring), from per-tile instructions."""
    by = {r["case"]: r for r in rows}
    tiles = (1e6 / BLOCK) ** 2
    sec_per_instr = 1e6 ** 2 / MEASURED["kv_t32_entries_per_s"] / tiles / by[CASES[0][0]]["before_instructions"]

    def seconds(tag: str, extra_derivative: bool) -> float:
        work = (args.cg_iterations * by[CASES[2][0]][f"{tag}_instructions"]
                + by[CASES[3][0]][f"{tag}_instructions"]
                + (by[CASES[5][0]][f"{tag}_instructions"] if extra_derivative else 0))
        return MEASURED["setup_1e6_s"] + tiles * work * sec_per_instr

    res = {"check_1e6_modelled_s": seconds("before", True), "check_1e6_measured_s": MEASURED["mll_1e6_s"],
           "before_1e6_s": seconds("before", False), "after_1e6_s": seconds("after", False)}
    spec = importlib.util.spec_from_file_location("distributed", Path(__file__).parent / "distributed.py")
    dist = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(dist)
    for tag in ("before", "after"):  # benchmarks/distributed.py's cost model, its defaults but the every-pair time
        model = dist.cost_model(SimpleNamespace(gpu_mll_1e6_s=res[f"{tag}_1e6_s"], gpu_cutoff_1e6_s=2.57, products=17,
                                                columns=17, link_gbs=100.0))
        res[f"{tag}_cost_model"] = model
        res[f"{tag}_1e7_8gpus_s"] = next(m["no_cutoff_s"] for m in model if m["n"] == 10**7 and m["gpus"] == 8)
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", default=None, help="baseline revision (git): its kernels, compiled alike")
    ap.add_argument("--d", type=int, default=3, help="dimensions (synthetic3d: 3)")
    ap.add_argument("--cg-iterations", type=int, default=MEASURED["cg_iterations_1e6"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.d < 1 or args.cg_iterations < 1:
        raise SystemExit("--d and --cg-iterations must be positive")
    record = provenance(__file__, argv)
    out = {**model(args), "provenance": record}
    print(f"instructions per 64 x 64 tile and thread, sm_90, Matérn-3/2, d = {args.d}, float32")
    print(f"{'case':40s} {'before':>8s} {'after':>8s} {'ratio':>6s} {'entries/s before':>17s} {'after':>9s} "
          f"{'spills':>7s}")
    for r in out["kernels"]:
        b = r.get("before_instructions")
        e0, e1 = r.get("before_entries_per_s"), r.get("after_entries_per_s")
        print(f"{r['case']:40s} {b if b else '-':>8} {r['after_instructions']:>8d} "
              f"{r['ratio'] if 'ratio' in r else math.nan:6.2f} {e0 or math.nan:17.3g} {e1 or math.nan:9.3g} "
              f"{r.get('before_spill_stores', '-')}/{r['after_spill_stores']:>3}")
    if "mll" in out:
        m = out["mll"]
        tf = next(r for r in out["kernels"] if r["case"] == CASES[1][0])
        print(f"check: TF32 product modelled {tf['before_entries_per_s']:.3g} entries/s, measured "
              f"{MEASURED['kv_t32_tf32_entries_per_s']:.3g}")
        print(f"MLL at 10^6, every pair: the H100 run of 000f71c modelled {m['check_1e6_modelled_s']:.1f} s (measured "
              f"{m['check_1e6_measured_s']} s); before {m['before_1e6_s']:.1f} s, after {m['after_1e6_s']:.1f} s")
        print(f"10^7 points on 8 GPUs, every pair: before {m['before_1e7_8gpus_s']:.0f} s, after "
              f"{m['after_1e7_8gpus_s']:.0f} s (target <= 300 s)")
        print("every pair, s per evaluation (benchmarks/distributed.py's cost model): n, GPUs, before, after")
        for b, a in zip(m["before_cost_model"], m["after_cost_model"]):
            print(f"  {a['n']:>9} {a['gpus']} {b['no_cutoff_s']:9.1f} {a['no_cutoff_s']:9.1f}")
    path = Path(args.out) if args.out else RESULTS / ("kernel_model_quick.json" if args.quick else "kernel_model.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print("wrote", path)
    return out


if __name__ == "__main__":
    main()
