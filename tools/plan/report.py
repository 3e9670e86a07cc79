"""Outputs of the plan explorer: the ranked terminal table (rich) and the PNG (matplotlib) with
the throughput-vs-TPOT frontier of every plan and per-GPU memory bars for the top plans."""

from __future__ import annotations

from .inputs import GIB


def _fmt(x, spec=".1f", none="-"):
    return none if x is None else format(x, spec)


def print_table(records, title: str, console=None, top: int | None = None):
    from rich.console import Console
    from rich.table import Table
    console = console or Console()
    table = Table(title=title, show_lines=False)
    # CB batch: decode batch that turns compute-bound at the workload's mean context.
    for col in ("#", "plan", "weights GiB", "KV tokens", "seqs", "TTFT ms",
                "TPOT@1 ms", "bound", "best batch", "TPOT ms", "tok/s", "CB batch", "note"):
        table.add_column(col, justify="left" if col in ("plan", "status", "note", "bound")
                         else "right")
    ok = [r for r in records if r["status"] == "ok"]
    for i, r in enumerate(ok if top is None else ok[:top], 1):
        m, best = r["memory_gib"], r["best"]
        note = "" if r["sla_ok"] else "misses SLA"
        if r["rate_ok"] is False:
            note = (note + "; " if note else "") + "rate not sustained"
        table.add_row(
            str(i), r["plan"], f"{m['weights']:.2f}", str(m["kv_tokens"]),
            str(m["kv_seqs"]), _fmt(r["ttft_ms"]), _fmt(r["decode_batch1"]["ms"], ".2f"),
            r["decode_batch1"]["bound"], _fmt(best and best["batch"], "d"),
            _fmt(best and best["tpot_ms"], ".2f"), _fmt(best and best["tok_s"], ".0f"),
            _fmt(r["compute_bound_batch"], "d", "never"), note, style=None if r["sla_ok"] else "red")
    console.print(table)
    rejected = [r for r in records if r["status"] != "ok"]
    if rejected:
        why = Table(title="plans that cannot run", show_header=True)
        for col in ("plan", "status", "why"):
            why.add_column(col, overflow="fold")
        for r in rejected:
            why.add_row(r["plan"], r["status"], r["reason"],
                        style="yellow" if r["status"] == "no-fit" else "dim")
        console.print(why)


def write_png(records, path: str, title: str, tpot_sla: float | None = None, top: int = 6):
    """Left: tok/s against TPOT for every fitting plan (one point per batch size), SLA as a
    vertical line. Right: stacked per-GPU memory of the `top` best plans."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ok = [r for r in records if r["status"] == "ok"]
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw=dict(width_ratios=[3, 2]))
    for r in ok:
        xs = [c["tpot_ms"] for c in r["curve"]]
        ys = [c["tok_s"] for c in r["curve"]]
        ax.plot(xs, ys, marker="o", ms=3, label=r["plan"])
    if tpot_sla:
        ax.axvline(tpot_sla, color="red", ls="--", label=f"TPOT SLA {tpot_sla:g} ms")
    ax.set(xlabel="TPOT (ms per output token)", ylabel="output tokens/s (all GPUs)",
           title="throughput vs TPOT, one point per decode batch", xscale="log", yscale="log")
    ax.grid(True, which="both", alpha=0.3)
    if ok:
        ax.legend(fontsize=7, ncol=2)
    shown = ok[:top]
    names = [r["plan"] for r in shown]
    parts = [("weights", "weights"), ("workspace", "workspace"), ("KV cache", "kv_gib"),
             ("headroom", "headroom")]
    bottom = [0.0] * len(shown)
    for label, key in parts:
        vals = [max(0.0, r["memory_gib"][key]) for r in shown]
        bars.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if shown:
        bars.axhline(shown[0]["memory_gib"]["budget"], color="black", ls=":", label="usable")
    bars.set(ylabel="GiB per GPU", title=f"memory per GPU, top {len(shown)} plans")
    bars.tick_params(axis="x", rotation=30, labelsize=7)
    bars.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def gib(x: float) -> float:
    return x / GIB
