"""``zchannel demo embodied``: train a policy end to end through zchannel channels.

Env, rollout and actor workers run as processes (or Ray actor groups with ``--ray``) and talk
over real brokers; the toy task (``PointReach``, 2-D point reaching with action chunks) needs no
simulator.  One table row per training step; at the end the trained policy's return is shown
beside a random policy's on the same environment seeds.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

COLUMNS = [("step", "{:>4}"), ("mean_return", "{:>8.2f}"), ("episode_length", "{:>6.1f}"),
           ("success_rate", "{:>6.2f}"), ("policy_lag", "{:>4.1f}"), ("env_steps_per_s", "{:>8.0f}"),
           ("chunks_per_s", "{:>7.1f}"), ("broker_bytes_held", "{:>9}")]
HEADER = "step   return    len   succ  lag  envst/s  chunk/s  brk-bytes"


def _row(record: dict) -> str:
    cells = []
    for name, fmt in COLUMNS:
        value = record.get(name)
        width = len(fmt.format(0)) if "d" not in fmt else 4
        cells.append(" " * width + "-" if value is None else fmt.format(value))
    return " ".join(cells)


def _plot(records: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.UsageError(
            "--plot needs matplotlib; install the extra: pip install 'zchannel[plot]'") from None
    steps = [r["step"] for r in records if r["mean_return"] is not None]
    returns = [r["mean_return"] for r in records if r["mean_return"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, returns, marker="o")
    ax.set_xlabel("training step")
    ax.set_ylabel("mean episode return")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


@click.group()
def demo() -> None:
    """Worked examples that run on one machine."""


@demo.command()
@click.option("--runner", type=click.Choice(["sync", "async", "decoupled"]), default="sync",
              show_default=True, help="service loops (docs/embodied.md)")
@click.option("--mode", type=click.Choice(["rollout", "pipeline"]), default="rollout",
              show_default=True, help="trajectory channel output mode")
@click.option("--envs", type=click.IntRange(1, 64), default=2, show_default=True,
              help="env workers (logical sources)")
@click.option("--env-batch", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="environments per env worker")
@click.option("--actors", type=click.IntRange(1, 64), default=1, show_default=True,
              help="actor workers")
@click.option("--steps", type=click.IntRange(1, 100000), default=20, show_default=True,
              help="training steps")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--ray", "use_ray", is_flag=True,
              help="run the workers as Ray actor groups (needs the 'ray' extra)")
@click.option("--ray-nodes", type=click.IntRange(1, 16), default=1, show_default=True,
              help="with --ray: simulate a cluster of this many nodes on this machine")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              help="write the run (config, one record per step, evaluation) as JSON")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              help="save the learning curve as PNG (needs the 'plot' extra: matplotlib)")
@click.option("--quiet", is_flag=True, help="no progress bar or table")
def embodied(runner: str, mode: str, envs: int, env_batch: int, actors: int, steps: int,
             seed: int, use_ray: bool, ray_nodes: int, json_path: str | None,
             plot_path: str | None, quiet: bool) -> None:
    """Train PPO on the PointReach toy task through zchannel (env → rollout → actors)."""
    from zchannel.embodied.policy import RandomPolicy
    from zchannel.embodied.runners import RunConfig, WorkerDied, evaluate, run, trained_policy

    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError(
                "--plot needs matplotlib; install the extra: pip install 'zchannel[plot]'"
            ) from None
    try:
        cfg = RunConfig(runner=runner, mode=mode, envs=envs, env_batch=env_batch,
                        actors=actors, steps=steps, seed=seed)
        cfg.plan(2)  # geometry errors (e.g. pipeline widths) before anything starts
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    records: list[dict] = []
    bar: Any = None
    if not quiet:
        click.echo(f"runner={runner} mode={mode} envs={envs}x{env_batch} actors={actors} "
                   f"steps={steps} seed={seed}{' ray' if use_ray else ''}")
        click.echo(HEADER)
        bar = click.progressbar(length=steps, label="training", file=sys.stderr)
        bar.__enter__()

    def on_step(record: dict) -> None:
        records.append(record)
        if not quiet:
            bar.update(1)
            click.echo("\r" + _row(record))

    try:
        if use_ray:
            from zchannel.embodied.ray_runner import run_on_ray

            result = run_on_ray(cfg, on_step=on_step, nodes=ray_nodes)
        else:
            result = run(cfg, on_step=on_step)
    except WorkerDied as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    policy = trained_policy(cfg, result["final_weights"])
    seeds = [10_000 + seed * 10 + i for i in range(3)]
    trained = [evaluate(cfg, policy, episodes_seed=s) for s in seeds]
    random = [evaluate(cfg, RandomPolicy(2, cfg.num_action_chunks, seed=s), episodes_seed=s)
              for s in seeds]

    def mean(rows: list[dict], name: str) -> float:
        return sum(r[name] for r in rows) / len(rows)

    evaluation = {"seeds": seeds, "trained_return": mean(trained, "mean_return"),
                  "random_return": mean(random, "mean_return"),
                  "trained_success": mean(trained, "success_rate"),
                  "random_success": mean(random, "success_rate")}
    click.echo(f"trained policy: return {evaluation['trained_return']:.2f}, success "
               f"{evaluation['trained_success']:.2f}   random policy: return "
               f"{evaluation['random_return']:.2f}, success {evaluation['random_success']:.2f}"
               f"   (same env seeds {seeds})")
    if result.get("placement"):
        click.echo(f"trajectory channel placed by Ray on node(s) {result['placement']}")
    click.echo(f"wall {result['wall_s']:.1f}s, policy lag mean "
               f"{sum(r['policy_lag'] for r in records) / len(records):.2f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": result["config"], "steps": records, "evaluation": evaluation,
                       "rollout": {k: v for k, v in result["rollout"].items() if k != "lags"},
                       "trajectory_channel_nodes": result.get("placement"),
                       "wall_s": result["wall_s"]}, f, indent=1)
        click.echo(f"wrote {os.path.abspath(json_path)} (config, one record per step, evaluation)")
    if plot_path:
        _plot(records, plot_path, f"PointReach, {runner} runner, {mode} mode")
        click.echo(f"wrote {os.path.abspath(plot_path)} (learning curve: mean return per step)")


__all__ = ["demo"]


@demo.command("embodied-bench")
@click.option("--steps", type=click.IntRange(3, 1000), default=8, show_default=True,
              help="training steps per run (the first is start-up and is not counted)")
@click.option("--repeats", type=click.IntRange(1, 20), default=1, show_default=True)
@click.option("--runners", default="sync,async", show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True))
def embodied_bench(steps: int, repeats: int, runners: str, json_path: str | None) -> None:
    """Throughput of the demo: each runner over brokers and over in-process channels, in one
    run; medians over the steady-state steps (step 0 includes worker start-up)."""
    import statistics

    from zchannel.embodied.runners import RunConfig, run

    rows = []
    for runner in [r.strip() for r in runners.split(",") if r.strip()]:
        for transport in ("broker", "inproc"):
            step_s, env_rate, chunk_rate = [], [], []
            for rep in range(repeats):
                result = run(RunConfig(runner=runner, transport=transport, steps=steps,
                                       seed=rep))
                steady = result["records"][1:]
                step_s += [r["step_s"] for r in steady]
                env_rate += [r["env_steps_per_s"] for r in steady]
                chunk_rate += [r["chunks_per_s"] for r in steady]
            rows.append({"runner": runner, "transport": transport,
                         "step_s": statistics.median(step_s),
                         "env_steps_per_s": statistics.median(env_rate),
                         "chunks_per_s": statistics.median(chunk_rate)})
            click.echo(f"{runner:>9} {transport:>7}: step {rows[-1]['step_s'] * 1000:7.1f} ms  "
                       f"env steps/s {rows[-1]['env_steps_per_s']:8.0f}  chunks/s "
                       f"{rows[-1]['chunks_per_s']:6.1f}")
    by = {(r["runner"], r["transport"]): r for r in rows}
    for runner in sorted({r["runner"] for r in rows}):
        broker, inproc = by[(runner, "broker")], by[(runner, "inproc")]
        share = 1 - inproc["step_s"] / broker["step_s"]
        click.echo(f"{runner}: channel share of the step wall time "
                   f"(1 - inproc/broker) = {share * 100:.1f} %")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
