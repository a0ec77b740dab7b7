"""Fit the five h100-gtt parameters no spec sheet gives (`FITTED`) to the paper's public statements; leave-one-out
cross-validation; `python -m cpinfer.perf.fit` prints the tables (`planning_doc.py` writes them into the docs).

Residual of a statement: ln(model / paper); Levenberg-Marquardt in ln(parameter) with box bounds and a weak pull
towards each physical prior. Leave-one-out refits without each fitted statement and predicts it.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

import numpy as np

from cpinfer.perf.catalog import FA3_L0, HARDWARE
from cpinfer.perf.hardware_profile import HardwareProfile
from cpinfer.perf.statements import STATEMENTS, Statement, profile_for

# parameter -> (lower, upper, prior, why the prior); bounds are physical limits on the 500 W GTT H100 / RDMA.
FITTED = {
    "gemm_efficiency": (0.2, 0.95, 0.70, "typical achieved/peak of large bf16/FP8 GEMMs on H100"),
    "attn_overhead_tokens": (1.0, 1600.0, FA3_L0, "the shape of FA3's published causal forward curve"),
    "inter_gbs": (1.0, 50.0, 25.0, "half the 50 GB/s NIC for NCCL SendRecv"),
    "inter_latency_us": (2.0, 200.0, 20.0, "RDMA SendRecv through NCCL's proxy"),
    "ring_step_us": (1.0, 2000.0, 30.0, "a few kernel launches and one cross-stream sync per ring step"),
}
PRIOR_WEIGHT = 0.01   # residual weight of ln(param / prior): a tie-breaker where no statement pins a parameter
TIPPING_WEIGHT = 5.0  # the tipping point is a 1% statement; weigh it like the others' 10%


def fitted_statements() -> list[Statement]:
    return [s for s in STATEMENTS if s.fit]


def _with(hw: HardwareProfile, x: np.ndarray) -> HardwareProfile:
    return dataclasses.replace(hw, **{k: float(math.exp(v)) for k, v in zip(FITTED, x)})


def residuals(hw: HardwareProfile, statements: list[Statement], x: np.ndarray) -> np.ndarray:
    """ln(model / paper) per statement (the tipping point weighted up), then the weak pulls towards the priors."""
    trial = _with(hw, x)
    res = [math.log(s.model(profile_for(s, trial)) / s.paper) * (TIPPING_WEIGHT if s.tol < 0.05 else 1.0)
           for s in statements]
    prior = [PRIOR_WEIGHT * (v - math.log(FITTED[k][2])) for k, v in zip(FITTED, x)]
    return np.asarray(res + prior)


def fit(statements: list[Statement] | None = None, start: HardwareProfile | None = None) -> dict:
    """Least-squares fit of FITTED on `statements` (default: every fitted statement); returns {name: value}."""
    statements = fitted_statements() if statements is None else statements
    hw = start or HARDWARE["h100-gtt"]
    lo = np.log([b[0] for b in FITTED.values()])
    hi = np.log([b[1] for b in FITTED.values()])
    # The model has max() in it (a transfer is hidden or it is not), so the objective has kinks and shallow
    # valleys: start from `hw` and from the priors, keep the best.
    starts = [np.log([getattr(hw, k) for k in FITTED]), np.log([b[2] for b in FITTED.values()])]
    best = None
    for x in starts:
        x = _levenberg_marquardt(hw, statements, np.clip(x, lo, hi), lo, hi)
        r = residuals(hw, statements, x)
        if best is None or r @ r < best[0]:
            best = (float(r @ r), x)
    return {k: float(math.exp(v)) for k, v in zip(FITTED, best[1])}


def _levenberg_marquardt(hw, statements, x, lo, hi, iters: int = 60) -> np.ndarray:
    """Box-bounded Levenberg-Marquardt in ln(parameter): a parameter at a bound whose gradient points out of the
    box is held there (active set), the others move freely."""
    r = residuals(hw, statements, x)
    lam = 1e-2
    for _ in range(iters):
        jac = np.empty((len(r), len(x)))
        for i in range(len(x)):  # one-sided differences, stepping inwards at an upper bound
            h = -1e-4 if x[i] + 1e-4 > hi[i] else 1e-4
            step = x.copy()
            step[i] += h
            jac[:, i] = (residuals(hw, statements, step) - r) / h
        g = jac.T @ r
        free = ~(((x <= lo + 1e-9) & (g > 0)) | ((x >= hi - 1e-9) & (g < 0)))
        if not free.any() or np.abs(g[free]).max() < 1e-10:
            break
        jf = jac[:, free]
        a, gf = jf.T @ jf, g[free]
        while lam < 1e8:
            new = x.copy()
            new[free] -= np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-9), gf)
            new = np.clip(new, lo, hi)
            r_new = residuals(hw, statements, new)
            if r_new @ r_new < r @ r:
                x, r, lam = new, r_new, max(lam / 3, 1e-6)
                break
            lam *= 4
        else:
            break
    return x


def cost(values: dict, statements: list[Statement] | None = None) -> float:
    """Sum of squared ln(model / paper) over the statements (default: the fitted ones) with these parameters."""
    hw = fitted_profile(values)
    statements = fitted_statements() if statements is None else statements
    return float(sum(math.log(s.model(profile_for(s, hw)) / s.paper) ** 2 for s in statements))


def fitted_profile(values: dict | None = None, base: HardwareProfile | None = None) -> HardwareProfile:
    base = base or HARDWARE["h100-gtt"]
    return dataclasses.replace(base, **(values if values is not None else fit()))


def leave_one_out(start: HardwareProfile | None = None) -> list[dict]:
    """For each fitted statement: refit on the others, predict it; the in-sample error beside it."""
    every = fitted_statements()
    full = fitted_profile(fit(every, start))
    rows = []
    for s in every:
        rest = [o for o in every if o is not s]
        hw = fitted_profile(fit(rest, full))
        rows.append(dict(key=s.key, paper=s.paper, in_sample=s.error(profile_for(s, full)),
                         held_out=s.error(profile_for(s, hw)), params={k: getattr(hw, k) for k in FITTED}))
    return rows


def determined_by() -> dict:
    """For each fitted parameter, the fitted statements whose model value moves by > 1% when the parameter is
    halved or set to its prior (whichever moves them more)."""
    every, hw = fitted_statements(), HARDWARE["h100-gtt"]
    base = {s.key: s.model(profile_for(s, hw)) for s in every}
    out = {}
    for name, (lo, _, prior, _) in FITTED.items():
        moved = set()
        for value in (max(lo, getattr(hw, name) / 2), prior):
            other = dataclasses.replace(hw, **{name: value})
            moved |= {s.key for s in every if abs(s.model(profile_for(s, other)) / base[s.key] - 1) > 0.01}
        out[name] = [s.key for s in every if s.key in moved]
    return out


def parameter_table(values: dict | None = None) -> str:
    """Markdown: each fitted parameter, catalog vs refit value, prior, bounds, the statements that move it."""
    hw, values = HARDWARE["h100-gtt"], values or fit()
    lines = ["| parameter | catalog | refit now | prior | bounds | moves (fitted statements) |",
             "|---|---|---|---|---|---|"]
    moves = determined_by()
    for name, (lo, hi, prior, why) in FITTED.items():
        lines.append(f"| `{name}` | {getattr(hw, name):g} | {values[name]:.4g} | {prior:g} ({why}) | {lo:g}-{hi:g} | "
                     f"{', '.join(moves[name]) or 'none by > 1%'} |")
    return "\n".join(lines)


def statement_table() -> str:
    """Markdown: every statement of the paper with its source, the model's value on h100-gtt, pass / fail."""
    from cpinfer.perf.statements import evaluate

    lines = ["| statement | source | model | paper | error | fitted | ok |", "|---|---|---|---|---|---|---|"]
    for r in evaluate(HARDWARE["h100-gtt"]):
        paper = f"{r['paper']:.4g}" if r["kind"] == "value" else "holds"
        err = f"{100 * r['error']:+.1f}%" if r["error"] is not None else f"margin {r['model']:.3g}"
        model = f"{r['model']:.4g}" if r["kind"] == "value" else "-"
        lines.append(f"| `{r['key']}`: {r['quote']} | {r['source']} | {model} | {paper} | {err} | "
                     f"{'fit' if r['fit'] else ''} | {'yes' if r['passes'] else 'NO'} |")
    return "\n".join(lines)


def loo_table(rows: list[dict]) -> str:
    """Markdown: leave-one-out rows, then one line with the median / worst held-out error."""
    lines = ["| held-out statement | paper | in-sample error | held-out error |", "|---|---|---|---|"]
    lines += [f"| `{r['key']}` | {r['paper']:g} | {100 * r['in_sample']:+.1f}% | {100 * r['held_out']:+.1f}% |"
              for r in rows]
    held = sorted(abs(r["held_out"]) for r in rows)
    worst = max(rows, key=lambda r: abs(r["held_out"]))
    lines += ["", f"Median held-out error {100 * float(np.median(held)):.1f}%, "
                  f"{sum(h <= 0.10 for h in held)} of {len(held)} within 10%; worst "
                  f"{100 * worst['held_out']:+.1f}% (`{worst['key']}`)."]
    return "\n".join(lines)


def report(loo: bool = True) -> str:
    """Markdown: the fitted parameters, every statement with model vs paper, and (optionally) leave-one-out."""
    parts = [parameter_table(), statement_table()]
    if loo:
        parts.append(loo_table(leave_one_out()))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cpinfer.perf.fit", description=__doc__.splitlines()[0])
    parser.add_argument("--no-loo", action="store_true", help="skip leave-one-out (the slow part)")
    args = parser.parse_args(argv)
    print(report(loo=not args.no_loo))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
