"""Server-side SVG charts for the console, each with a text equivalent.

Charts are drawn here rather than in the browser so the pages need no charting library,
work without JavaScript, and every figure can carry the same numbers as text (a one-line
summary plus a small data table) for screen readers and for tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from markupsafe import Markup, escape

from runtime.core.metrics import StepSample

W, H = 360, 130                      # viewBox; the SVG scales to its container's width
ML, MR, MT, MB = 46, 8, 8, 20        # margins: room for y labels on the left, x labels below
Fmt = Callable[[float], str]


def pct(v: float) -> str:
    return f"{v * 100:.1f}%"


def num(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def ms(v: float) -> str:
    """Seconds as a short axis label: "12.5 ms", "200 ms" (no decimal past 100 ms: "200.0 ms"
    did not fit the left margin and showed as "00.0 ms"), "1.5 s"."""
    if v >= 1:
        return f"{v:.1f} s"
    return f"{v * 1000:.1f} ms" if v < 0.1 else f"{v * 1000:.0f} ms"


@dataclass(frozen=True)
class Series:
    name: str
    values: Sequence[float | None]


@dataclass(frozen=True)
class Chart:
    cid: str
    title: str
    svg: Markup
    summary: str                                  # the text equivalent, one sentence
    columns: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)  # a sampled data table


def _nice_max(v: float) -> float:
    """Round an axis maximum up to 1, 2 or 5 x 10^k so tick labels stay short."""
    if v <= 0:
        return 1.0
    k = 1.0
    while k * 10 <= v:
        k *= 10
    while k > v:
        k /= 10
    for m in (1, 2, 5, 10):
        if m * k >= v:
            return m * k
    return 10 * k


def _paths(xs: Sequence[float], ys: Sequence[float | None], x0: float, x1: float, ymax: float) -> str:
    """One SVG path; None values break the line so idle gaps are not drawn as data."""
    pw, ph = W - ML - MR, H - MT - MB
    span = (x1 - x0) or 1.0
    out: list[str] = []
    run = 0  # points in the current unbroken run
    for x, y in zip([*xs, None], [*ys, None], strict=True):
        if y is None or x is None:
            if run == 1:
                out.append("l0.01 0")  # a lone sample: with round caps this draws a dot
            run = 0
            continue
        px = ML + (x - x0) / span * pw
        py = MT + ph - min(max(y, 0.0), ymax) / ymax * ph
        out.append(f"{'L' if run else 'M'}{px:.1f} {py:.1f}")
        run += 1
    return "".join(out)


def span_label(seconds: float) -> str:
    return f"{seconds / 60:g} min" if seconds >= 120 else f"{seconds:.0f} s"


def line_chart(cid: str, title: str, xs: Sequence[float], series: Sequence[Series], fmt: Fmt,
               y_max: float | None = None, horizon_s: float | None = None) -> Chart:
    """xs are seconds relative to now (<= 0); values may be None (no data in that bin).
    horizon_s names the time span in the axis label and the text equivalent."""
    horizon = horizon_s if horizon_s is not None else (-xs[0] if xs else 0.0)
    present = [v for s in series for v in s.values if v is not None]
    ymax = y_max if y_max is not None else _nice_max(max(present, default=0.0))
    x0, x1 = (xs[0], xs[-1]) if xs else (-1.0, 0.0)
    ph = H - MT - MB
    parts = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-labelledby="{cid}-t {cid}-d" '
             f'id="{cid}-svg"><title id="{cid}-t">{escape(title)}</title>'
             f'<desc id="{cid}-d">{{desc}}</desc>']
    for frac in (0.0, 0.5, 1.0):
        y = MT + ph - frac * ph
        parts.append(f'<line class="grid" x1="{ML}" x2="{W - MR}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="ax" x="{ML - 4}" y="{y + 3:.1f}" text-anchor="end">'
                     f'{escape(fmt(frac * ymax))}</text>')
    parts.append(f'<text class="ax" x="{ML}" y="{H - 5}">−{span_label(horizon)}</text>'
                 f'<text class="ax" x="{W - MR}" y="{H - 5}" text-anchor="end">now</text>')
    for i, s in enumerate(series):
        d = _paths(xs, s.values, x0, x1, ymax)
        if d:
            parts.append(f'<path class="ln s{i}" d="{d}"/>')
    if not present:
        parts.append(f'<text class="ax nodata" x="{(ML + W - MR) / 2}" y="{MT + ph / 2}" '
                     f'text-anchor="middle">no data yet</text>')
    parts.append("</svg>")
    summary = _summary(title, horizon, series, fmt)
    svg = Markup("".join(parts).replace("{desc}", str(escape(summary)), 1))
    columns, rows = _table(xs, series, fmt)
    return Chart(cid, title, svg, summary, columns, rows)


def _summary(title: str, horizon_s: float, series: Sequence[Series], fmt: Fmt) -> str:
    horizon = f"last {span_label(horizon_s)}"
    bits = []
    for s in series:
        vals = [v for v in s.values if v is not None]
        if not vals:
            bits.append(f"{s.name}: no data")
            continue
        bits.append(f"{s.name}: latest {fmt(vals[-1])}, min {fmt(min(vals))}, max {fmt(max(vals))}")
    return f"{title} ({horizon}). " + "; ".join(bits) + "."


def _table(xs: Sequence[float], series: Sequence[Series], fmt: Fmt, max_rows: int = 10
           ) -> tuple[list[str], list[list[str]]]:
    if not xs:
        return [], []
    step = max(1, len(xs) // max_rows)
    idx = list(range(len(xs) - 1, -1, -step))[:max_rows]  # newest first
    cols = ["time", *[s.name for s in series]]
    rows = [[f"{int(xs[i])} s", *[("—" if s.values[i] is None else fmt(s.values[i])) for s in series]]
            for i in idx]
    return cols, rows


def occupancy_bar(counts: dict[str, int], num_blocks: int, watermark_blocks: int) -> Markup:
    """Stacked used | shared | cached | free bar with the watermark reserve hatched at the
    end: admissions stop once free + cached blocks would drop into the hatched part."""
    n = max(num_blocks, 1)
    x = 0.0
    parts = ['<svg class="occ" viewBox="0 0 1000 30" preserveAspectRatio="none" role="img" '
             'aria-labelledby="occ-t"><title id="occ-t">KV block occupancy with the watermark reserve</title>'
             '<defs><pattern id="hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
             'patternTransform="rotate(45)"><line x1="0" y1="0" x2="0" y2="6" class="hatch"/></pattern></defs>']
    for state in ("used", "shared", "cached", "free"):
        w = counts.get(state, 0) / n * 1000
        if w > 0:
            parts.append(f'<rect class="b-{state}" x="{x:.2f}" y="0" width="{w:.2f}" height="30"/>')
        x += w
    rx = (n - watermark_blocks) / n * 1000
    if watermark_blocks:
        parts.append(f'<rect fill="url(#hatch)" x="{rx:.2f}" y="0" width="{1000 - rx:.2f}" height="30"/>')
    parts.append(f'<line class="wm" x1="{rx:.2f}" x2="{rx:.2f}" y1="0" y2="30"/></svg>')
    return Markup("".join(parts))


# --- recent-window binning: StepSamples -> per-bin series ------------------------------------
@dataclass(frozen=True)
class Binned:
    xs: list[float]
    hit_rate: list[float | None]
    evictions_per_s: list[float | None]
    running: list[float | None]
    waiting: list[float | None]
    tokens_per_step: list[float | None]
    step_time: list[float | None]
    output_tps: list[float | None]
    used_blocks: list[float | None]


def bin_steps(steps: Sequence[StepSample], now: float, horizon_s: float = 180.0, bin_s: float = 3.0) -> Binned:
    """Aggregate per-step samples into fixed bins ending at `now` (monotonic seconds).
    Cumulative counters become per-bin rates from the last sample before each bin."""
    nb = int(horizon_s // bin_s)
    start = now - nb * bin_s
    buckets: list[list[StepSample]] = [[] for _ in range(nb)]
    prev: StepSample | None = None
    for s in steps:
        if s.t < start:
            prev = s
        elif s.t <= now:
            buckets[min(nb - 1, int((s.t - start) // bin_s))].append(s)
    out: dict[str, list[float | None]] = {k: [] for k in Binned.__dataclass_fields__ if k != "xs"}
    for b in buckets:
        if not b:
            for k in out:
                out[k].append(None)
            continue
        last, base = b[-1], prev or b[0]
        dq, dh = last.prefix_queries - base.prefix_queries, last.prefix_hits - base.prefix_hits
        out["hit_rate"].append(dh / dq if dq > 0 else None)
        out["evictions_per_s"].append(max(0, last.evictions - base.evictions) / bin_s)
        out["running"].append(float(max(s.num_running for s in b)))
        out["waiting"].append(float(max(s.num_waiting for s in b)))
        busy = [s for s in b if s.num_tokens > 0]
        out["tokens_per_step"].append(sum(s.num_tokens for s in busy) / len(busy) if busy else None)
        out["step_time"].append(sum(s.step_time for s in busy) / len(busy) if busy else None)
        out["output_tps"].append(sum(s.new_tokens for s in b) / bin_s)
        out["used_blocks"].append(float(max(s.used_blocks for s in b)))
        prev = last
    xs = [-(nb - i - 1) * bin_s for i in range(nb)]
    return Binned(xs=xs, **out)
