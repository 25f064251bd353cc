"""Held-out τ against the training blocks a drafter has seen: the points a run logs (`tau/held_out` with `blocks`),
a least-squares fit τ = a + b·ln(blocks) over them (or over where each piece of training ended), the blocks that
fit puts at τ 3 and 4, and the plot. Used by `scripts/tau_by_training.py --from-logs` and by the model card a training
run writes (`model_card.py`)."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

GOALS = (3.0, 4.0)


def rows_from_logs(log_history: list[dict], key: str = "tau/held_out", blocks_before: int = 0) -> list[dict]:
    """`[{"step", "blocks", "tau"}]` for each logged `key` that carries the blocks seen (in step order, one per
    step), with `blocks_before` added."""
    rows = {}
    for entry in log_history:
        if key in entry and "blocks" in entry:
            rows[entry["step"]] = {"step": entry["step"], "blocks": entry["blocks"] + blocks_before, "tau": entry[key]}
    return [rows[step] for step in sorted(rows)]


def fit_log_curve(blocks, taus) -> tuple[float, float]:
    """Least-squares `(a, b)` of τ = a + b·ln(blocks) over points with blocks > 0 (needs two distinct block
    counts)."""
    points = [(math.log(x), y) for x, y in zip(blocks, taus) if x > 0]
    if len({x for x, _ in points}) < 2:
        raise ValueError("the fit needs τ at two or more different block counts")
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    b = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return my - b * mx, b


def blocks_for(tau: float, a: float, b: float) -> float | None:
    """Blocks at which the fit reaches `tau` (None when the fit does not rise)."""
    return math.exp((tau - a) / b) if b > 0 else None


def plot_compute(rows: list[dict], fit: tuple[float, float], goals: dict, path: Path, rate: float | None,
                 earlier: list[dict] = (), compare: list[dict] = (), fitted: list[dict] = (),
                 fit_over: str = "") -> None:
    """Held-out τ against blocks seen (log axis), the fitted curve extended to the τ goals, each goal marked with its
    blocks (and CPU hours at `rate` blocks per second); `earlier` points (label, blocks, τ) drawn beside, not fitted;
    `fitted` points (earlier pieces' ends that the fit includes) drawn filled; `compare` points (label, blocks, τ:
    another drafter on the same prompts, e.g. the DFlash baseline) drawn apart. `fit_over` names the fit's points in
    its legend entry."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    if earlier:
        ax.plot([r["blocks"] for r in earlier], [r["tau"] for r in earlier], "s", color="grey",
                label="earlier rounds (not fitted)")
        for r in earlier:
            ax.annotate(r["label"], (r["blocks"], r["tau"]), textcoords="offset points", xytext=(4, -10), fontsize=6)
    if fitted:
        ax.plot([r["blocks"] for r in fitted], [r["tau"] for r in fitted], "D", color="dimgrey",
                label="earlier pieces' ends (fitted)")
        for r in fitted:
            ax.annotate(r["label"], (r["blocks"], r["tau"]), textcoords="offset points", xytext=(4, -10), fontsize=6)
    ax.plot([r["blocks"] for r in rows], [r["tau"] for r in rows], "o", color="C0", label="held-out τ (logged)")
    if compare:
        ax.plot([r["blocks"] for r in compare], [r["tau"] for r in compare], "^", color="C3",
                label="other drafters, same prompts (not fitted)")
        for r in compare:
            ax.annotate(r["label"], (r["blocks"], r["tau"]), textcoords="offset points", xytext=(6, -12), fontsize=6,
                        color="C3")
    reach = [x for x in goals.values() if x] + [r["blocks"] for r in rows]
    lo, hi = min(r["blocks"] for r in [*rows, *earlier, *compare, *fitted]), max(reach) * 1.5
    xs = [lo * (hi / lo) ** (i / 99) for i in range(100)]
    ax.plot(xs, [fit[0] + fit[1] * math.log(x) for x in xs], "--", color="C1",
            label=f"fit τ = {fit[0]:.2f} + {fit[1]:.3f}·ln(blocks)" + (f" over {fit_over}" if fit_over else ""))
    for tau, blocks in goals.items():
        ax.axhline(tau, color="grey", lw=0.8, ls=":")
        if blocks:
            hours = f", {blocks / rate / 3600:,.0f} h" if rate else ""
            ax.annotate(f"τ {tau}: {blocks:.2g} blocks{hours}", (blocks, tau), textcoords="offset points",
                        xytext=(-120, 6), fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("training blocks seen (anchors with a supervised row)")
    ax.set_ylabel("τ: held-out, greedy, whole blocks")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def curve(log_history: list[dict], blocks_before: int = 0, key: str = "tau/held_out", goals=GOALS,
          fit_points: list[dict] | None = None) -> dict | None:
    """The run's points, fit, goals (blocks, and hours at the run's median logged `blocks_per_second`) as a dict;
    None when the log holds `key` at fewer than two different block counts. `fit_points` (`{"blocks", "tau"}`, e.g.
    where pieces of training ended): fit these instead of every logged point (the fit then lists them as `points`)."""
    rows = [r for r in rows_from_logs(log_history, key, blocks_before) if r["blocks"] > 0]  # a log axis
    try:
        fit = fit_log_curve([r["blocks"] for r in rows], [r["tau"] for r in rows])
    except ValueError:
        return None
    if fit_points is not None:
        fit = fit_log_curve([p["blocks"] for p in fit_points], [p["tau"] for p in fit_points])
    rates = [e["blocks_per_second"] for e in log_history if "blocks_per_second" in e]
    rate = statistics.median(rates) if rates else None
    goals = {tau: blocks_for(tau, *fit) for tau in goals}
    return {"key": key, "blocks_before": blocks_before, "rows": rows,
            "fit": {"a": fit[0], "b": fit[1], "form": "tau = a + b * ln(blocks)",
                    **({} if fit_points is None else {"points": [{"blocks": p["blocks"], "tau": p["tau"]}
                                                                 for p in fit_points]})},
            "blocks_per_second": rate,
            "goals": {str(t): {"blocks": x, "hours": x / rate / 3600 if x and rate else None}
                      for t, x in goals.items()}}


SETTINGS = ("prompts", "max_new_tokens")  # what an end's held-out τ was measured with


def piece_ends(log_history: list[dict], blocks_before: int = 0, ends_before=(), key: str = "tau/held_out",
               settings: dict | None = None, blocks_now: int | None = None) -> list[dict]:
    """Where each piece of training ended, `[{"blocks", "tau", "prompts", "max_new_tokens"}]`: `ends_before` (the
    starting drafter's `held_out_tau_ends`, all kept) and this run's last logged `key` on the whole block count, with
    the eval `settings` it was measured with. The run's own end is added only when that τ was logged after it trained
    (its start-of-run τ is the starting drafter's end measured again) and, with `blocks_now` (the blocks this run has
    seen), at that count: a checkpoint saved before the run's last eval records no end of its own."""
    rows = rows_from_logs(log_history, key, blocks_before)
    ends = [{**{k: e[k] for k in SETTINGS if k in e}, "blocks": int(e["blocks"]), "tau": float(e["tau"])}
            for e in ends_before]
    if rows and rows[-1]["blocks"] > blocks_before and (blocks_now is None
                                                         or rows[-1]["blocks"] == blocks_before + blocks_now):
        ends.append({**(settings or {}), "blocks": rows[-1]["blocks"], "tau": rows[-1]["tau"]})
    return ends


def comparable(ends: list[dict], settings: dict | None) -> list[dict]:
    """The ends measured with `settings` (the same number of prompts and new tokens), which one fit may join; all of
    them when `settings` is None."""
    if settings is None:
        return list(ends)
    return [e for e in ends if all(e.get(k) == settings.get(k) for k in SETTINGS)]


def card_section(log_history: list[dict], folder, blocks_before: int = 0, ends_before=(),
                 settings: dict | None = None) -> str | None:
    """Markdown for a model card: held-out τ against blocks seen, with `tau_by_compute.png` drawn into `folder`;
    None when the run logged held-out τ at fewer than two points. With `ends_before` (where the earlier pieces the
    starting drafter came from ended), the fit runs through the pieces' ends (theirs and this run's last point, each
    on an annealed learning rate) instead of every logged point: a piece restarted at its peak learning rate dips
    before it recovers, and those dips would pull a fit over every point down. `settings`: the run's eval settings
    (`{"prompts", "max_new_tokens"}`); only earlier ends measured the same way join the fit."""
    ends = comparable(piece_ends(log_history, blocks_before, ends_before, settings=settings), settings)
    fit_points = ends if len({e["blocks"] for e in ends}) >= 2 else None
    result = curve(log_history, blocks_before, fit_points=fit_points)
    if result is None:
        return None
    fit = (result["fit"]["a"], result["fit"]["b"])
    goals = {float(t): g["blocks"] for t, g in result["goals"].items()}
    earlier = [{"label": f"piece {i + 1}", **e} for i, e in enumerate(ends[:-1])] if fit_points else []
    plot_compute(result["rows"], fit, goals, Path(folder) / "tau_by_compute.png", result["blocks_per_second"],
                 fitted=earlier, fit_over="the pieces' ends" if fit_points else "")
    first, last = result["rows"][0], result["rows"][-1]
    reach = "; ".join(f"τ {t:g} at {x:.3g} blocks" if x else f"τ {t:g} not reached by the fit"
                      for t, x in goals.items())
    over = (f"Fit through where each of the {len(fit_points)} pieces of training ended (the earlier pieces' ends, "
            f"recorded in the config's `held_out_tau_ends`, and this run's last point)" if fit_points
            else "Fit over every logged point")
    return (f"Held-out τ (the trainer's `tau/held_out`: held-out TRAIN prompts, greedy, whole blocks) against "
            f"training blocks seen: {first['tau']:.3f} at {first['blocks']:,} blocks to {last['tau']:.3f} at "
            f"{last['blocks']:,} ({len(result['rows'])} points). {over}: τ = {fit[0]:.2f} + {fit[1]:.3f}·ln(blocks): "
            f"{reach}.\n\n![held-out τ against training blocks seen](tau_by_compute.png)")
