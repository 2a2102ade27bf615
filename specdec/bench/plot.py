"""The report's PNG: speedup by category and method; acceptance by draft position; and, when the
run has them, throughput under concurrency, latency under open-loop arrivals and speedup under
network delay."""

from __future__ import annotations

from pathlib import Path

from specdec.bench.methods import is_speculative


def plot_report(report: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch1 = report["batch1"]
    extra = [p for p in ("concurrency", "arrivals", "netem") if report.get(p)]
    fig, axes = plt.subplots(1, 2 + len(extra), figsize=(7 + 5 * (1 + len(extra)), 4.8), squeeze=False,
                             gridspec_kw={"width_ratios": [2.2] + [1] * (1 + len(extra))})
    axes = axes[0]
    run = [m for m, v in report["methods"].items() if v["status"] == "run"]
    colors = {m: f"C{i % 10}" for i, m in enumerate(run)}  # one colour per method in every panel
    _speedup_by_category(axes[0], batch1, colors)
    _acceptance_by_position(axes[1], batch1["overall"], colors)
    for ax, part in zip(axes[2:], extra):
        {"concurrency": _concurrency, "arrivals": _arrivals, "netem": _netem}[part](ax, report[part], colors)
    meta = report["meta"]
    where = (f"{meta['machine']['cores']} CPU cores, {meta['threads']} thread(s) per process" if meta["device"] == "cpu"
             else meta["device"])
    fig.suptitle(f"target {meta['models']['target_name']}, draft {meta['models'].get('draft_name') or '-'}: "
                 f"{meta['prompts']['count']} prompts, {meta['sampling']['max_new_tokens']} new tokens, greedy, "
                 f"{where}, {meta['dtype']}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _speculative(table: dict) -> list[str]:
    return [m for m, v in table.items() if is_speculative(m) and v.get("speedup") is not None]


def _speedup_by_category(ax, batch1: dict, colors: dict) -> None:
    methods = _speculative(batch1["overall"])
    groups = ["overall"] + sorted(batch1["by_category"])
    tables = [batch1["overall"]] + [batch1["by_category"][c] for c in groups[1:]]
    width = 0.8 / max(1, len(methods))
    for i, method in enumerate(methods):
        values = [t.get(method, {}).get("speedup") or 0.0 for t in tables]
        ax.bar([g + i * width - 0.4 + width / 2 for g in range(len(groups))], values, width, label=method,
               color=colors.get(method))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("speedup over its baseline (x)")
    ax.set_title("Speedup by category (specdec-*: over plain; hf-*: over hf-greedy)", fontsize=9)
    ax.legend(fontsize=7)


def _acceptance_by_position(ax, overall: dict, colors: dict) -> None:
    for method, values in overall.items():
        accept = values.get("acceptance_by_position") if isinstance(values, dict) else None
        if accept:
            ax.plot(range(1, len(accept) + 1), [a if a is not None else float("nan") for a in accept],
                    marker="o", label=method, color=colors.get(method))
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance (accepted / drafted there)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position", fontsize=9)
    ax.legend(fontsize=7)


def _concurrency(ax, concurrency: dict, colors: dict) -> None:
    levels = sorted(concurrency, key=float)
    methods = [m for m in colors if any(m in t for t in concurrency.values())]
    for method in methods:
        ax.plot([int(lv) for lv in levels], [concurrency[lv].get(method, {}).get("tokens_per_s") for lv in levels],
                marker="o", label=method, color=colors.get(method))
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(lv) for lv in levels], [str(lv) for lv in levels])
    ax.set_xlabel("concurrent sessions")
    ax.set_ylabel("output tokens/s (all sessions)")
    ax.set_title("Throughput under concurrency", fontsize=9)
    ax.legend(fontsize=7)


def _arrivals(ax, arrivals: dict, colors: dict) -> None:
    """Mean (solid) and p99 (dashed) end-to-end latency from arrival against the offered rate."""
    rates = sorted(arrivals, key=float)
    for method in [m for m in colors if any(m in t for t in arrivals.values())]:
        xs = [float(r) for r in rates if method in arrivals[r]]
        ax.plot(xs, [arrivals[r][method]["e2e_mean_s"] for r in rates if method in arrivals[r]], marker="o",
                label=method, color=colors.get(method))
        ax.plot(xs, [arrivals[r][method]["e2e_p99_s"] for r in rates if method in arrivals[r]], linestyle="--",
                color=colors.get(method))
    ax.set_xlabel("offered load, requests/s (Poisson arrivals)")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("end-to-end latency from arrival, s (mean; dashed: p99)")
    ax.set_title("Open-loop load", fontsize=9)
    ax.legend(fontsize=7)


def _netem(ax, netem: dict, colors: dict) -> None:
    levels = sorted(netem["levels"], key=float)
    methods = [m for m in colors if any((netem["levels"][lv].get(m) or {}).get("speedup") for lv in levels)]
    for method in methods:
        ax.plot([float(lv) for lv in levels], [netem["levels"][lv].get(method, {}).get("speedup") for lv in levels],
                marker="o", label=method, color=colors.get(method))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel(f"added delay each direction, ms ({netem['network']['mode']})")
    ax.set_ylim(bottom=0)
    ax.set_ylabel("speedup over plain at the same delay (x)")
    ax.set_title("Cross-node latency", fontsize=9)
    ax.legend(fontsize=7)
