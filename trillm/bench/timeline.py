"""--plot-timeline: an HTML page (inline SVG, no script, no dependency) with one row per
request: the wait for the first token, then each inter-token gap colored by
--timeline-itl-thresholds (green below the first, orange between, red above the second).
--plot-dataset-stats: a PNG of the dataset's prompt and output lengths (matplotlib).
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from trillm.bench.metrics import RequestResult

ROW_PX = 6
WIDTH_PX = 1200
LEFT_PX = 60
COLORS = ("#2ca02c", "#ff7f0e", "#d62728")  # ITL below / between / above the thresholds
PREFILL_COLOR = "#9e9e9e"
FAILED_COLOR = "#000000"


def _itl_color(gap_s: float, thresholds: tuple[float, float]) -> str:
    ms = gap_s * 1000
    return COLORS[0] if ms < thresholds[0] else COLORS[1] if ms < thresholds[1] else COLORS[2]


def timeline_segments(
    results: list[RequestResult], t0: float, thresholds: tuple[float, float]
) -> list[list[tuple[float, float, str]]]:
    """Per request: (start s, end s, color) from t0: the TTFT wait, then each ITL gap."""
    rows = []
    for r in results:
        start = r.start_time - t0
        if not r.success:
            rows.append([(start, start + r.latency, FAILED_COLOR)])
            continue
        segments = [(start, start + r.ttft, PREFILL_COLOR)]
        at = start + r.ttft
        for gap in r.itl:
            segments.append((at, at + gap, _itl_color(gap, thresholds)))
            at += gap
        rows.append(segments)
    return rows


def write_timeline(
    path: Path, results: list[RequestResult], t0: float, thresholds: tuple[float, float]
) -> None:
    rows = timeline_segments(sorted(results, key=lambda r: r.start_time), t0, thresholds)
    end = max((seg[1] for row in rows for seg in row), default=1.0) or 1.0
    scale = (WIDTH_PX - LEFT_PX) / end
    height = ROW_PX * len(rows) + 30
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH_PX}" height="{height}">',
        f'<text x="{LEFT_PX}" y="{height - 8}" font-size="11">0 s ... {end:.3f} s</text>',
    ]
    for i, row in enumerate(rows):
        y = i * ROW_PX
        for start, stop, color in row:
            x, w = LEFT_PX + start * scale, max((stop - start) * scale, 0.5)
            tip = html.escape(f"request {i}: {start:.3f}-{stop:.3f} s")
            parts.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW_PX - 1}" '
                f'fill="{color}"><title>{tip}</title></rect>'
            )
    parts.append("</svg>")
    legend = (
        f"grey: waiting for the first token; ITL green &lt; {thresholds[0]:g} ms, orange &lt; "
        f"{thresholds[1]:g} ms, red above; black: failed"
    )
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Request timeline</title>"
        f"</head><body><p>{len(rows)} requests. {legend}</p>{''.join(parts)}</body></html>"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)


def plot_dataset_stats(path: Path, requests: list[Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prompts = [r.prompt_len for r in requests]
    outputs = [r.expected_output_len for r in requests]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, values, title in zip(
        axes,
        (prompts, outputs, [p + o for p, o in zip(prompts, outputs)]),
        ("prompt tokens", "output tokens", "prompt + output tokens"),
    ):
        ax.hist(values, bins=min(50, max(len(set(values)), 1)))
        ax.set_title(f"{title} (n={len(values)})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
