"""``zchannel demo embodied``: train a policy end to end through zchannel channels.

Env, rollout and actor workers run as processes (or Ray actor groups with ``--ray``) and talk
over real brokers; the default task (``PointReach``, 2-D point reaching with action chunks) needs
no simulator, ``--env gym:<id>`` trains on any Gymnasium env (``--env-kwargs`` JSON; the
reference hyperparameters of ``zchannel.embodied.presets`` where it has them).  One table row per
training step; at the end the trained policy's return is shown beside a random policy's on the
same environment seeds.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click
from zchannel.cli.failures import (
    TOO_DEEP,
    given_on_command_line,
    output_file,
    require_companions,
)
from zchannel.cli.workdir import import_from_cwd

if TYPE_CHECKING:  # the demo imports zchannel.embodied when it runs
    from zchannel.embodied.runners import RunConfig
    from zchannel.embodied.spaces import EnvSpec

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


def _json_option(text: str | None, name: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=name) from None
    except RecursionError:  # Python's parser recurses once per array or object
        raise click.BadParameter(TOO_DEEP, param_hint=name) from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint=name)
    return value


def _plot(records: list[dict], path: str, title: str, random_return: float | None = None) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise click.UsageError(
            "--plot needs matplotlib; install the extra: pip install 'zchannel[plot]'") from None
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in records if r["mean_return"] is not None]
    returns = [r["mean_return"] for r in records if r["mean_return"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, returns, marker="o" if len(steps) <= 50 else None,
            label="trained (episodes finished in the step)")
    if random_return is not None:
        ax.axhline(random_return, color="gray", linestyle="--", label="random policy")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("training step")
    ax.set_ylabel("mean episode return")
    ax.legend(loc="best")
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
@click.option("--mode", type=click.Choice(["rollout", "pipeline", "lerobot"]), default="rollout",
              show_default=True,
              help="trajectory channel output mode (lerobot: record episodes, no training)")
@click.option("--dataset", "dataset", type=click.Path(file_okay=False),
              help="with --mode lerobot: write the episodes as a LeRobot v3 dataset here "
                   "(needs the 'dataset' extra)")
@click.option("--overwrite", is_flag=True, help="replace an existing --dataset directory")
@click.option("--fps", "lerobot_fps", type=click.IntRange(1, 1000), default=10,
              show_default=True, help="with --mode lerobot: frame rate of the recorded episodes")
@click.option("--only-success", is_flag=True,
              help="with --mode lerobot: keep only episodes that end in success")
@click.option("--env", "env_name", default="point_reach", show_default=True,
              help="'point_reach' or 'gym:<id>' (any Gymnasium id: 'gym:CartPole-v1', "
                   "'gym:<module>:<EnvId>'; needs the 'gym' extra)")
@click.option("--env-kwargs", default=None, metavar="JSON",
              help='keyword arguments of the env, e.g. \'{"max_episode_steps": 200}\'')
@click.option("--obs-map", default=None, metavar="JSON",
              help='gym: observation leaf -> image key, e.g. \'{"pixels": "main_images"}\'')
@click.option("--envs", type=click.IntRange(1, 64), default=None,
              help="env workers (logical sources)  [default: the env's preset; 2]")
@click.option("--env-batch", type=click.IntRange(1, 4096), default=None,
              help="environments per env worker  [default: the env's preset; 32]")
@click.option("--actors", type=click.IntRange(1, 64), default=1, show_default=True,
              help="actor workers")
@click.option("--steps", type=click.IntRange(1, 100000), default=None,
              help="training steps  [default: the env's preset; 20]")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True,
              help="the run's seed (>= 0: Gymnasium needs non-negative seeds)")
@click.option("--ray", "use_ray", is_flag=True,
              help="run the workers as Ray actor groups (needs the 'ray' extra)")
@click.option("--ray-nodes", type=click.IntRange(1, 16), default=1, show_default=True,
              help="with --ray: simulate a cluster of this many nodes on this machine")
@click.option("--liveness", type=click.IntRange(1, 1000), default=None,
              help="heartbeats (1 s) a peer of the run's brokers may miss before it is taken "
                   "for gone  [default: 30 for the trajectory broker, whose collector works on "
                   "a whole step in one turn; 3 for the others]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              callback=output_file,
              help="write the run (config, one record per step, evaluation) as JSON")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True),
              callback=output_file,
              help="save the learning curve as PNG (needs the 'plot' extra: matplotlib)")
@click.option("--quiet", is_flag=True, help="no progress bar or table")
def embodied(runner: str, mode: str, dataset: str | None, overwrite: bool, lerobot_fps: int,
             only_success: bool, env_name: str, env_kwargs: str | None,
             obs_map: str | None, envs: int | None, env_batch: int | None, actors: int,
             steps: int | None, seed: int, use_ray: bool, ray_nodes: int, liveness: int | None,
             json_path: str | None, plot_path: str | None, quiet: bool) -> None:
    """Train PPO through zchannel (env → rollout → actors) on PointReach or a Gymnasium env, or
    with --mode lerobot record its episodes (as a LeRobot v3 dataset with --dataset DIR)."""
    from zchannel.embodied.presets import preset
    from zchannel.embodied.runners import check_recordable, env_spec

    given = {k: v for k, v in dict(envs=envs, env_batch=env_batch, steps=steps,
                                   liveness=liveness).items() if v is not None}
    _check_plot_extra(plot_path)
    _check_dataset_extra(dataset)
    import_from_cwd()
    require_companions({"ray_nodes": "use_ray", "overwrite": "dataset"})
    try:
        if mode != "lerobot" and (dataset or only_success or given_on_command_line("lerobot_fps")):
            raise ValueError("--dataset, --only-success and --fps need --mode lerobot")
        if dataset and os.path.exists(dataset) and not overwrite:
            raise ValueError(f"--dataset {dataset} exists: pass --overwrite to replace it")
        cfg = preset(env_name, runner=runner, mode=mode, actors=actors, seed=seed,
                     env_kwargs=_json_option(env_kwargs, "--env-kwargs") or {},
                     obs_map=_json_option(obs_map, "--obs-map"), dataset=dataset or "",
                     overwrite=overwrite, lerobot_fps=lerobot_fps,
                     lerobot_only_success=only_success, **given)
        _check_split(cfg)  # in the demo's own options, before the plan names its fields
        spec = env_spec(cfg)  # an env that cannot be made or carried is refused here
        cfg.plan(spec.action_dim)  # geometry errors (e.g. pipeline widths) before anything starts
        check_recordable(cfg)  # lerobot mode: recordable cameras (a dataset: 1 or 3 channels)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise click.UsageError(str(exc)) from None
    envs, env_batch, steps = cfg.envs, cfg.env_batch, cfg.steps
    records: list[dict] = []
    bar: Any = None
    if not quiet:
        click.echo(f"env={env_name} runner={runner} mode={mode} envs={envs}x{env_batch} "
                   f"actors={actors} "
                   f"steps={steps} seed={seed}{' ray' if use_ray else ''}")
        click.echo(HEADER)
        bar = click.progressbar(length=steps, file=sys.stderr,
                                label="recording" if mode == "lerobot" else "training")
        bar.__enter__()

    def on_step(record: dict) -> None:
        records.append(record)
        if not quiet:
            bar.update(1)
            click.echo("\r" + _row(record))

    try:
        result = _run_demo(cfg, on_step, ray_nodes if use_ray else None)
    finally:
        if bar is not None:
            bar.__exit__(None, None, None)
    if mode == "lerobot":
        _report_recording(result, records, json_path)
        return
    _report_training(cfg, spec, result, records, json_path, plot_path,
                     f"{env_name}, {runner} runner, {mode} mode")


def _check_split(cfg: RunConfig) -> None:
    """``ValueError`` naming ``--envs``, ``--env-batch`` and ``--actors`` when the envs cannot
    be split evenly among the actors (the plan would name fields a demo user never set).  Rollout
    mode splits each env worker's batch into ``actors / gcd(envs, actors)`` equal shards;
    pipeline mode splits all ``envs × env_batch`` envs among the actors."""
    shards = cfg.actors // math.gcd(cfg.envs, cfg.actors)
    if cfg.mode == "rollout" and cfg.env_batch % shards:
        of = f"--actors {cfg.actors}" if shards == cfg.actors else \
            f"{shards} (--actors {cfg.actors} / gcd(--envs {cfg.envs}, --actors {cfg.actors}))"
        raise ValueError(f"--env-batch {cfg.env_batch} must be a multiple of {of}: each env "
                         "worker's envs are split evenly among the actors")
    total = cfg.envs * cfg.env_batch
    if cfg.mode == "pipeline" and total % cfg.actors:
        raise ValueError(f"--envs {cfg.envs} x --env-batch {cfg.env_batch} = {total} envs cannot "
                         f"be split evenly among --actors {cfg.actors}")


def _mean(evaluations: list[dict], name: str) -> float | None:
    """The mean of ``name`` over the episodes of ``evaluations`` (``evaluate`` results, each
    weighted by its episodes); None when none finished an episode."""
    counted = [r for r in evaluations if r["episodes"]]
    episodes = sum(r["episodes"] for r in counted)
    return sum(r[name] * r["episodes"] for r in counted) / episodes if episodes else None


def _figures(evaluation: dict, policy: str) -> str:
    """``policy``'s (trained or random) return and success in ``evaluation``, or that no
    episode finished."""
    if evaluation[f"{policy}_return"] is None:
        return "no episode finished"
    return (f"return {evaluation[f'{policy}_return']:.2f}, success "
            f"{evaluation[f'{policy}_success']:.2f}")


def _report_training(cfg: RunConfig, spec: EnvSpec, result: dict, records: list[dict],
                     json_path: str | None, plot_path: str | None, title: str) -> None:
    """The end of a training run: the trained and a random policy evaluated
    (``_evaluations``), the run's figures and the files asked for (``--json``, ``--plot``).
    ``--json`` gets the training records before the evaluation (``"evaluation": null``) and
    the evaluation once it is done, so an evaluation that fails or is interrupted leaves the
    records; one that fails (its env raised) is a ``ClickException`` naming the exception and
    the files written (``error: ...``, status 2)."""
    training = {"config": result["config"], "steps": records, "evaluation": None,
                "episodes": result["episodes"],
                "rollout": {k: v for k, v in result["rollout"].items() if k != "lags"},
                "trajectory_channel_nodes": result.get("placement"), "wall_s": result["wall_s"]}
    if json_path:
        _write_json(json_path, training)
    try:
        evaluation = _evaluations(cfg, spec, result["final_weights"])
    except Exception as exc:  # an env's failure: whatever it raises
        kept = [f"--json {os.path.abspath(json_path)} has the training records"] if json_path \
            else []
        if plot_path:
            _plot(records, plot_path, title)
            kept.append(f"--plot {os.path.abspath(plot_path)} the learning curve")
        raise click.ClickException(
            f"the evaluation after training failed: {type(exc).__name__}: {exc}"
            + (f" ({'; '.join(kept)})" if kept else "")) from exc
    if result.get("placement"):
        click.echo(f"trajectory channel placed by Ray on node(s) {result['placement']}")
    click.echo(f"wall {result['wall_s']:.1f}s, policy lag mean "
               f"{sum(r['policy_lag'] for r in records) / len(records):.2f}")
    if json_path:
        _write_json(json_path, {**training, "evaluation": evaluation})
        click.echo(f"wrote {os.path.abspath(json_path)} (config, one record per step, evaluation)")
    if plot_path:
        _plot(records, plot_path, title, evaluation["random_return"])
        click.echo(f"wrote {os.path.abspath(plot_path)} (learning curve: mean return per step)")


def _evaluations(cfg: RunConfig, spec: EnvSpec, final_weights: dict) -> dict[str, Any]:
    """The trained and a random policy evaluated on the same env seeds (``evaluation_seeds``:
    the first episode of each of 3 x ``env_batch`` envs, every env with its own seed), the
    figures printed; the ``--json`` ``evaluation``."""
    from zchannel.embodied.policy import RandomPolicy
    from zchannel.embodied.runners import evaluate, evaluation_seeds, trained_policy

    policy = trained_policy(cfg, final_weights)
    seeds = evaluation_seeds(cfg, 3)  # 3 x env_batch envs, each with its own seed
    trained = [evaluate(cfg, policy, episodes_seed=s) for s in seeds]
    random = [evaluate(cfg, RandomPolicy(spec.action_dim, cfg.num_action_chunks, seed=s,
                                         action=spec.action), episodes_seed=s)
              for s in seeds]
    evaluation: dict[str, Any] = {"seeds": seeds, "trained_return": _mean(trained, "mean_return"),
                  "random_return": _mean(random, "mean_return"),
                  "trained_success": _mean(trained, "success_rate"),
                  "random_success": _mean(random, "success_rate")}
    click.echo(f"trained policy: {_figures(evaluation, 'trained')}   random policy: "
               f"{_figures(evaluation, 'random')}   (first episode of each of {len(seeds)} x "
               f"{cfg.env_batch} envs, same env seeds {seeds})")
    unfinished = sum(r["unfinished"] for r in trained + random)
    if unfinished:
        click.echo(f"({unfinished} evaluation envs finished no episode within the chunk limit "
                   "and are not counted)")
    return evaluation


def _write_json(path: str, value: dict) -> None:
    """Write ``value`` to ``path`` as JSON, whole or not at all: into a temporary file of the
    same directory, renamed over ``path`` (a reader never sees half a file)."""
    partial = f"{path}.partial-{os.getpid()}"
    try:
        with open(partial, "w") as f:
            json.dump(value, f, indent=1)
        os.replace(partial, path)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)


def _run_demo(cfg: RunConfig, on_step: Callable[[dict], Any], ray_nodes: int | None) -> dict:
    """Run ``cfg`` (on a Ray cluster of ``ray_nodes`` nodes unless None); a worker's failure
    (and in lerobot mode a recording's) is a ``ClickException``."""
    from zchannel.embodied.runners import WorkerDied, run

    try:
        if ray_nodes is not None:
            from zchannel.embodied.ray_runner import run_on_ray

            return run_on_ray(cfg, on_step=on_step, nodes=ray_nodes)
        return run(cfg, on_step=on_step)
    except (WorkerDied, FileExistsError) as exc:
        raise click.ClickException(str(exc)) from None
    except (RuntimeError, ValueError) as exc:
        if cfg.mode != "lerobot":
            raise
        raise click.ClickException(str(exc)) from None  # dataset extra missing, no episodes


def _check_plot_extra(plot_path: str | None) -> None:
    """``--plot`` needs matplotlib (the ``plot`` extra): say so before the run."""
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.UsageError(
                "--plot needs matplotlib; install the extra: pip install 'zchannel[plot]'"
            ) from None


def _check_dataset_extra(dataset: str | None) -> None:
    """``--dataset`` needs pyarrow and Pillow (the ``dataset`` extra): say so before the run,
    not after its brokers and workers started and recorded."""
    if dataset:
        try:
            for module in ("pyarrow.parquet", "PIL.Image"):
                importlib.import_module(module)
        except ImportError:
            raise click.UsageError("--dataset needs pyarrow and Pillow; install the extra: "
                                   "pip install 'zchannel[dataset]'") from None


def _report_recording(result: dict, records: list[dict], json_path: str | None) -> None:
    """The end of a ``--mode lerobot`` run: what was recorded, and where."""
    episodes = sum(r.get("episodes_recorded", 0) for r in records)
    frames = sum(r.get("frames_recorded", 0) for r in records)
    click.echo(f"recorded {episodes} episodes ({frames} frames) in {len(records)} steps, "
               f"wall {result['wall_s']:.1f}s")
    summary = result.get("dataset")
    if summary is not None:
        click.echo(f"LeRobot v3.0 dataset written to {summary.root}: {summary.episodes} "
                   f"episodes, {summary.frames} frames, tasks {summary.tasks}; load it with "
                   f"LeRobotDataset('<any>/<name>', root={summary.root!r})")
    else:
        click.echo("no --dataset given: the episodes were not written")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"config": result["config"], "steps": records,
                       "dataset": None if summary is None else summary.root,
                       "wall_s": result["wall_s"]}, f, indent=1)
        click.echo(f"wrote {os.path.abspath(json_path)} (config, one record per step, dataset)")


__all__ = ["demo"]


@demo.command("embodied-bench")
@click.option("--steps", type=click.IntRange(3, 1000), default=8, show_default=True,
              help="training steps per run (the first is start-up and is not counted)")
@click.option("--repeats", type=click.IntRange(1, 20), default=1, show_default=True)
@click.option("--runners", default="sync,async", show_default=True)
@click.option("--env", "env_name", default="point_reach", show_default=True,
              help="'point_reach' or 'gym:<id>' (the image task: "
                   "gym:zchannel.embodied.toyenvs:TwoCameraReach-v0)")
@click.option("--env-kwargs", default=None, metavar="JSON",
              help='keyword arguments of the env, e.g. \'{"size": 128}\'')
@click.option("--env-batch", "env_batches", default=None, metavar="N[,N...]",
              help="envs per env worker, one run per value  [default: the env's preset]")
@click.option("--num-chunks", type=click.IntRange(1, 4096), default=None,
              help="action chunks per training step  [default: the env's preset]")
@click.option("--ppo-epochs", type=click.IntRange(1, 100), default=None,
              help="PPO epochs per training step  [default: the env's preset]")
@click.option("--shm-threshold", type=click.IntRange(0, None), default=None,
              help="bytes from which the requests and trajectory brokers use shared memory "
                   "(tensors under 64 KiB travel inline anyway)  [default: 64 KiB for envs with "
                   "images, else the channel's 1 MiB]")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True),
              callback=output_file)
def embodied_bench(steps: int, repeats: int, runners: str, env_name: str,
                   env_kwargs: str | None, env_batches: str | None, num_chunks: int | None,
                   ppo_epochs: int | None, shm_threshold: int | None,
                   json_path: str | None) -> None:
    """Throughput of the demo: each runner over brokers and over in-process channels, in one
    run; medians over the steady-state steps (step 0 includes worker start-up).  The channel's
    share of the step wall time is 1 - in-process / brokers."""
    import statistics
    from dataclasses import replace

    from zchannel.embodied.presets import preset
    from zchannel.embodied.runners import run

    import_from_cwd()
    base = preset(env_name, env_kwargs=_json_option(env_kwargs, "--env-kwargs") or {},
                  steps=steps, shm_threshold=shm_threshold)
    if num_chunks is not None:
        base = replace(base, num_chunks=num_chunks)
    if ppo_epochs is not None:
        base = replace(base, ppo=replace(base.ppo, epochs=ppo_epochs))
    try:
        batches = [int(b) for b in env_batches.split(",")] if env_batches else [base.env_batch]
    except ValueError:
        raise click.BadParameter("a comma-separated list of ints",
                                 param_hint="--env-batch") from None
    click.echo(f"env={env_name} steps={steps} repeats={repeats} num_chunks={base.num_chunks} "
               f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for batch in batches:
        for runner in [r.strip() for r in runners.split(",") if r.strip()]:
            for transport in ("broker", "inproc"):
                step_s, env_rate, chunk_rate = [], [], []
                for rep in range(repeats):
                    result = run(replace(base, runner=runner, transport=transport,
                                         env_batch=batch, seed=rep))
                    steady = result["records"][1:]
                    step_s += [r["step_s"] for r in steady]
                    env_rate += [r["env_steps_per_s"] for r in steady]
                    chunk_rate += [r["chunks_per_s"] for r in steady]
                rows.append({"env_batch": batch, "runner": runner, "transport": transport,
                             "step_s": statistics.median(step_s),
                             "env_steps_per_s": statistics.median(env_rate),
                             "chunks_per_s": statistics.median(chunk_rate)})
                click.echo(f"{batch:>4} envs {runner:>9} {transport:>7}: step "
                           f"{rows[-1]['step_s'] * 1000:7.1f} ms  env steps/s "
                           f"{rows[-1]['env_steps_per_s']:8.0f}  chunks/s "
                           f"{rows[-1]['chunks_per_s']:6.1f}")
    by = {(r["env_batch"], r["runner"], r["transport"]): r for r in rows}
    for batch, runner in sorted({(r["env_batch"], r["runner"]) for r in rows}):
        broker, inproc = by[(batch, runner, "broker")], by[(batch, runner, "inproc")]
        share = 1 - inproc["step_s"] / broker["step_s"]
        rows.append({"env_batch": batch, "runner": runner, "channel_share": share})
        click.echo(f"{batch} envs, {runner}: channel share of the step wall time "
                   f"(1 - inproc/broker) = {share * 100:.1f} %")
    click.echo(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(rows, f, indent=1)
        click.echo(f"wrote the figures as JSON to {os.path.abspath(json_path)}")
