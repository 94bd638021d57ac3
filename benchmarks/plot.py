"""--plot: batch size and tokens per second over time for every run (needs matplotlib)."""


def timelines(results: dict[str, dict]) -> list[tuple[str, list[list]]]:
    """(title, timeline) of every run that recorded one, in scenario order."""
    out = []
    for name, result in results.items():
        runs = result.get("runs", {})
        items = enumerate(runs) if isinstance(runs, list) else runs.items()
        for label, run in items:
            if run.get("timeline"):
                out.append((f"{name}: {label if isinstance(label, str) else f'run {label}'}",
                            run["timeline"]))
    return out


def plot(results: dict[str, dict], path: str) -> None:
    """One panel per run: batch size (steps) on the left axis, tok/s (log) on the right."""
    try:
        import matplotlib
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[plot]'") from e
    matplotlib.use("Agg")  # files only; no display on benchmark machines
    import matplotlib.pyplot as plt

    panels = timelines(results)
    if not panels:
        raise SystemExit("--plot: no run recorded a timeline")
    cols = 2 if len(panels) > 1 else 1
    num_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(num_rows, cols, figsize=(7 * cols, 2.8 * num_rows), squeeze=False)
    for ax, (title, timeline) in zip(axes.flat, panels):
        # entry: [start s, duration s, is_prefill, batch size, tokens]
        starts = [e[0] for e in timeline]
        ax.step(starts, [e[3] for e in timeline], where="post", color="tab:blue", lw=1)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("batch size", color="tab:blue")
        ax.set_xlabel("time (s)")
        ax.set_title(title, fontsize=9)
        rate = ax.twinx()
        for is_prefill, color, label in ((False, "tab:orange", "decode"),
                                          (True, "tab:green", "prefill")):
            points = [(e[0], e[4] / e[1]) for e in timeline if e[2] == is_prefill and e[1] > 0]
            if points:
                rate.plot(*zip(*points), ".", ms=2, color=color, label=f"{label} tok/s")
        rate.set_yscale("log")
        rate.set_ylabel("tok/s")
        rate.legend(loc="upper right", fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot: {len(panels)} runs -> {path}")


def main() -> None:
    """`python -m benchmarks.plot RESULTS.json OUT.png`: plot a --json file elsewhere (for
    machines where matplotlib cannot be installed)."""
    import json
    import sys
    if len(sys.argv) != 3:
        raise SystemExit("usage: python -m benchmarks.plot RESULTS.json OUT.png")
    with open(sys.argv[1]) as f:
        data = json.load(f)
    # bench.py --scenario throughput writes its one result at top level
    plot(data.get("scenarios") or {data.get("scenario", "throughput"): data}, sys.argv[2])


if __name__ == "__main__":
    main()
