"""Server-side SVG charts and the recent-window binning behind them."""

from __future__ import annotations

import re

from console import charts
from runtime.core.metrics import StepSample


def sample(t: float, *, queries: int = 0, hits: int = 0, evictions: int = 0, tokens: int = 0, new: int = 0,
           running: int = 0, waiting: int = 0, step_time: float = 0.0, used: int = 0) -> StepSample:
    return StepSample(t, step_time, tokens, running, waiting, new, queries, hits, evictions, used, 0)


def test_bin_steps_turns_cumulative_counters_into_per_bin_rates():
    now = 100.0
    steps = [
        sample(80.0, queries=100, hits=10, evictions=5),            # before the horizon: the baseline
        sample(91.0, queries=150, hits=40, evictions=5, tokens=8, new=4, running=2, step_time=0.01, used=7),
        sample(92.0, queries=200, hits=60, evictions=11, tokens=0, new=0, running=1, waiting=3),  # idle step
        sample(98.5, queries=200, hits=60, evictions=11, tokens=4, new=2, running=1, step_time=0.03, used=9),
    ]
    b = charts.bin_steps(steps, now, horizon_s=12.0, bin_s=3.0)
    assert b.xs == [-9.0, -6.0, -3.0, 0.0]
    # Bin [88, 91) has no samples; [91, 94) has two, [94, 97) none, [97, 100] one.
    assert b.hit_rate == [None, (60 - 10) / (200 - 100), None, None]
    assert b.evictions_per_s == [None, 6 / 3.0, None, 0.0]
    assert b.tokens_per_step == [None, 8.0, None, 4.0]          # idle steps do not dilute the mean
    assert b.step_time == [None, 0.01, None, 0.03]
    assert b.output_tps == [None, 4 / 3.0, None, 2 / 3.0]
    assert b.running == [None, 2.0, None, 1.0] and b.waiting == [None, 3.0, None, 0.0]
    assert b.used_blocks == [None, 7.0, None, 9.0]


def test_line_chart_breaks_lines_at_gaps_and_marks_lone_points():
    series = [charts.Series("hit", [0.5, None, 0.25, 0.75]), charts.Series("other", [None, 1.0, None, None])]
    c = charts.line_chart("c-x", "Hit rate <per interval>", [-3.0, -2.0, -1.0, 0.0], series, charts.pct, y_max=1.0)
    svg = str(c.svg)
    assert svg.startswith('<svg class="chart"') and 'role="img"' in svg
    assert "&lt;per interval&gt;" in svg  # escaped
    paths = re.findall(r'<path class="ln s(\d)" d="([^"]+)"/>', svg)
    assert [p[0] for p in paths] == ["0", "1"]
    assert paths[0][1].count("M") == 2 and "l0.01 0" in paths[0][1]   # 0.5 alone, then 0.25 -> 0.75
    assert paths[1][1].count("M") == 1 and "l0.01 0" in paths[1][1]
    assert c.summary == ("Hit rate <per interval> (last 3 s). hit: latest 75.0%, min 25.0%, max 75.0%; "
                         "other: latest 100.0%, min 100.0%, max 100.0%.")
    assert f'<desc id="c-x-d">{c.summary.replace("<", "&lt;").replace(">", "&gt;")}</desc>' in svg
    assert c.columns == ["time", "hit", "other"] and c.rows[0] == ["0 s", "75.0%", "—"]


def test_line_chart_without_data_says_so():
    c = charts.line_chart("c-y", "Step time", [-6.0, -3.0, 0.0], [charts.Series("step", [None, None, None])],
                          charts.ms, horizon_s=180)
    assert "no data yet" in str(c.svg) and "<path" not in str(c.svg)
    assert c.summary == "Step time (last 3 min). step: no data."


def test_axis_maximum_is_rounded_up():
    c = charts.line_chart("c-z", "t", [-1.0, 0.0], [charts.Series("v", [3.0, 7.3])], charts.num)
    assert ">10</text>" in str(c.svg) and ">5</text>" in str(c.svg)


def test_occupancy_bar_segments_and_watermark():
    svg = str(charts.occupancy_bar({"used": 250, "shared": 50, "cached": 200, "free": 500}, 1000, 100))
    assert '<rect class="b-used" x="0.00" y="0" width="250.00"' in svg
    assert '<rect class="b-shared" x="250.00" y="0" width="50.00"' in svg
    assert '<rect class="b-cached" x="300.00" y="0" width="200.00"' in svg
    assert '<line class="wm" x1="900.00"' in svg and 'fill="url(#hatch)" x="900.00"' in svg


def test_step_time_labels_fit_the_left_margin():
    """A 200 ms step-time axis once read "00.0 ms": its label was wider than the margin."""
    import re

    assert [charts.ms(v) for v in (0.0125, 0.1, 0.2, 0.95, 1.5)] == ["12.5 ms", "100 ms", "200 ms", "950 ms", "1.5 s"]
    for top in (0.2, 0.5, 2.0):
        c = charts.line_chart("c-s", "Step time", [-3.0, 0.0], [charts.Series("step", [top * 0.9, top])], charts.ms)
        labels = re.findall(r'text-anchor="end">([^<]+)</text>', str(c.svg))
        widest = max(len(t) for t in labels if t != "now")
        assert widest * 6.0 <= charts.ML - 4, labels  # 10px system-ui digits and letters are under 6px wide
