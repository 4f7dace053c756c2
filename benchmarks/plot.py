"""The overhead plot: ledgered export time over each baseline's, against rows, one line per format and baseline."""

from __future__ import annotations

from pathlib import Path


def plot_overhead(document: dict, path: Path, compare: dict | None = None, compare_label: str = "after") -> dict:
    """Writes the PNG; returns where it went, or why it was skipped (matplotlib is the optional ``bench`` extra).

    ``compare``, a second results document (for example the same run with a proposed change), is drawn in grey.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker
    except ImportError:
        return {"skipped": "matplotlib is not installed (pip install -e '.[bench]')"}

    results = document["benchmarks"]["export_overhead"]["results"]
    fig, ax = plt.subplots(figsize=(9.5, 4.2), dpi=120)
    styles = {"csv": "-", "parquet": "--"}
    for file_format in ("csv", "parquet"):
        rows = sorted((r for r in results if r["format"] == file_format), key=lambda r: r["rows"])
        if not rows:
            continue
        xs = [r["rows"] for r in rows]
        ax.plot(
            xs,
            [r["ratio_vs_arrow"] for r in rows],
            styles[file_format],
            marker="o",
            color="tab:blue",
            label=f"{file_format}: ledgered / plain pyarrow write (b)",
        )
        ax.plot(
            xs,
            [r["ratio_vs_pandas"] for r in rows],
            styles[file_format],
            marker="s",
            color="tab:orange",
            label=f"{file_format}: ledgered / pandas to_{file_format} (a)",
        )
    if compare is not None:
        for file_format in ("csv", "parquet"):
            rows = sorted(
                (r for r in compare["benchmarks"]["export_overhead"]["results"] if r["format"] == file_format),
                key=lambda r: r["rows"],
            )
            ax.plot(
                [r["rows"] for r in rows],
                [r["ratio_vs_arrow"] for r in rows],
                styles[file_format],
                marker="o",
                color="tab:grey",
                alpha=0.8,
                label=f"{file_format}: ledgered / (b), {compare_label}",
            )
    ax.axhline(1.10, color="tab:blue", linewidth=0.8, linestyle=":", label="target vs (b), csv: 1.1 at 1M rows")
    ax.axhline(1.30, color="tab:orange", linewidth=0.8, linestyle=":", label="target vs (b), parquet: 1.3 at 1M rows")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.25, 0.5, 1, 2, 4, 8]))
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("rows in the partition")
    ax.set_ylabel("time ratio (lower is better)")
    mode = document["mode"]
    ax.set_title(f"export-ledger overhead per partition ({document['started_utc'][:10]}, {mode} run)", fontsize=10)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return {"path": str(path)}


if __name__ == "__main__":
    # Redraw from results files: python -m benchmarks.plot RESULTS.json OUT.png [COMPARE.json [LABEL]]
    import json
    import sys

    def _load(name: str) -> dict:
        return json.loads(Path(name).read_text(encoding="utf-8"))

    other = _load(sys.argv[3]) if len(sys.argv) > 3 else None
    print(plot_overhead(_load(sys.argv[1]), Path(sys.argv[2]), other, *sys.argv[4:5]))
