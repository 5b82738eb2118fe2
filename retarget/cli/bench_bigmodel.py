"""The rows the big-model suites (`bigload`, `offload`) add to bench/README.md's full table."""

from __future__ import annotations

Row = tuple[str, str, str]


def big_load_rows(d: dict) -> list[Row]:
    growth = d["peak_rss_growth / weights"]
    rows = []
    for base, name in (("plain", "plain + load_state_dict"), ("accelerate", "Accelerate's")):
        time_ratio = d[f"time_ratio empty_init/{base}"]
        rss_ratio = d[f"peak_rss_ratio empty_init/{base}"]
        rows.append(("big-model load", f"empty init + load: time / {name}", f"{time_ratio:.2f}x"))
        rows.append(
            ("big-model load", f"empty init + load: peak RSS / {name}", f"{rss_ratio:.2f}x")
        )
    mapped = d["time_ratio empty_init_mmap/accelerate"]
    rows.append(
        ("big-model load", "empty init + load(mmap=True): time / Accelerate's", f"{mapped:.2f}x")
    )
    figures = ", ".join(f"{growth[v]:.2f}x" for v in ("empty_init", "plain", "accelerate"))
    rows.append(
        ("big-model load", "peak RSS / one copy of weights (ours, plain, Accelerate)", figures)
    )
    return rows


def offload_rows(d: dict) -> list[Row]:
    rows = [
        (
            "disk offload",
            "RssAnon growth / (budget + largest block)",
            f"{d['anon_growth ours / (budget + largest block)']:.2f}x",
        )
    ]
    for figure in ("time_per_token", "peak_rss"):
        rows.append(
            (
                "disk offload",
                f"{figure} ours / Accelerate",
                f"{d[f'{figure} ours/accelerate']:.2f}x",
            )
        )
    rows.append(
        (
            "disk offload",
            "cold load time hidden by prefetch",
            f"{d['load time hidden by prefetch']:.0%}",
        )
    )
    return rows
