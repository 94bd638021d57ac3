"""Benchmarks: upstream nano-vLLM's throughput workload by default, and a matrix of scenarios that
each run a variant against its baseline in one process (see README.md, "Benchmarks")."""
import json
import time

from benchmarks.cli import SCENARIO_NAMES, parse_args, resolve_model


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    import torch  # noqa: F401  (timed, as nanovllm)

    import nanovllm  # noqa: F401  (timed: the import cost users pay)
    import_s = time.perf_counter() - t0
    from benchmarks.plot import plot
    from benchmarks.report import report
    from benchmarks.runs import machine_env
    from benchmarks.scenarios import SCENARIOS

    path = resolve_model(args)
    names = SCENARIO_NAMES if args.scenario == "all" else (args.scenario,)
    env = dict(machine_env(args), import_s=import_s)
    results = {}
    for name in names:
        results[name] = dict(SCENARIOS[name](args, path), scenario=name)
        results[name]["environment"] = {**env, **results[name].pop("engine", {})}
        if name == "throughput":  # the keys bench.py --json has always written at top level
            results[name].update(command=env["command"], import_s=import_s)
        report(name, results[name])
    if args.json:
        out = results["throughput"] if names == ("throughput",) else dict(
            command=env["command"], environment=env, scenarios=results)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
