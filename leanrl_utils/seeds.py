"""--num-seeds in one process: parameters stacked on a leading dimension, a module's forward over the
stack, and one Run per seed, logged and finished together."""

import math
from dataclasses import replace

import torch
from tensordict import from_module

from leanrl_utils import checks
from leanrl_utils.run import Run


def stack(networks):
    """The networks' parameters stacked (flat names -> [seeds, ...]); each network's become views of
    its slice, so it acts, evaluates and saves with its seed's current weights."""
    stacked = torch.stack([from_module(net).data for net in networks]).contiguous()
    for k, net in enumerate(networks):
        stacked[k].to_module(net)
    return stacked.flatten_keys(".")


def forward(module, shared=()):
    """`module`'s forward over stacked seeds: (params from `stack`, *inputs [seeds, rows, ...]) ->
    [seeds, rows, ...] (vmap of functional_call); `shared`: positions of inputs every seed takes
    whole. A stack of one runs the module's own ops: exactly what the module computes."""

    def call(p, *inputs):
        return torch.func.functional_call(module, p, inputs)

    def forward(params, *inputs):
        if next(iter(params.values())).shape[0] > 1:
            in_dims = tuple(None if i in shared else 0 for i in range(len(inputs)))
            return torch.func.vmap(call, in_dims=(0, *in_dims))(dict(params), *inputs)
        one = {name: p.squeeze(0) for name, p in params.items()}  # squeeze: the gradient keeps its layout
        out = call(one, *(x if i in shared else x[0] for i, x in enumerate(inputs)))
        return tuple(y.unsqueeze(0) for y in out) if isinstance(out, tuple) else out.unsqueeze(0)

    return forward


def vmap(fn, num_seeds):
    """`fn(params, *inputs)` of one agent over stacked seeds: torch.func.vmap, or for a stack of one
    the agent's own ops (as `forward`)."""
    if num_seeds > 1:
        return torch.func.vmap(fn)

    def unsqueeze(out):
        if isinstance(out, (tuple, list)):
            return type(out)(unsqueeze(x) for x in out)
        return {k: unsqueeze(x) for k, x in out.items()} if isinstance(out, dict) else out.unsqueeze(0)

    def one(params, *inputs):
        return unsqueeze(fn({name: p[0] for name, p in params.items()}, *(x[0] for x in inputs)))

    return one


def runs(args, total_steps, script, resumed=None, rank=0):
    """One Run per seed of --num-seeds (seeds seed ... seed + num_seeds - 1), the first the lead."""
    num_seeds = getattr(args, "num_seeds", 1)
    checks.open_files(num_seeds)
    lead = Run(args, total_steps, script, resumed, rank=rank)
    others = [replace(args, seed=args.seed + k) for k in range(1, num_seeds)]
    return [lead] + [Run(seed_args, total_steps, script, resumed, lead=lead) for seed_args in others]


def seed_slice(infos, k, num_envs):
    """Seed k's share of a vector env's infos: the values of its sub-envs, k * num_envs onwards."""
    part = slice(k * num_envs, (k + 1) * num_envs)
    return {key: seed_slice(value, k, num_envs) if isinstance(value, dict) else value[part] for key, value in infos.items()}


def episodes(runs, step, infos, num_envs):
    """Each seed's finished episodes (sub-env k * num_envs + i is env i of seed k)."""
    info = infos.get("final_info", infos)
    if len(runs) == 1:
        runs[0].episodes(step, info)
    elif "_episode" in info and info["_episode"].any():
        for k, run in enumerate(runs):
            run.episodes(step, seed_slice(info, k, num_envs))


def log(runs, step, updates, metrics, names, networks, **charts):
    """A log point of every seed (`metrics`: [len(names), seeds] or None; `networks`: each seed's).
    False after a non-finite loss, which stops every seed. note: a host sync."""
    seed_stats = [{}] * len(runs)
    if metrics is not None:
        seed_stats = [dict(zip(names, values)) for values in metrics.reshape(len(names), len(runs)).T.tolist()]
    for k, stats in enumerate(seed_stats):
        # explained variance is NaN by design when a batch's returns are constant (as in CleanRL)
        losses = [name for name in names if name.startswith("losses/") and name != "losses/explained_variance"]
        bad = next((name for name in losses if not math.isfinite(stats.get(name, 0.0))), None)
        if bad:
            which = f" (seed {runs[k].args.seed})" if len(runs) > 1 else ""
            for run in runs:
                run.stop_reason = f"non-finite {bad.removeprefix('losses/')} {stats[bad]} at step {step}{which}"
            return False
    for run, stats, nets in zip(runs, seed_stats, networks):
        run.log(step, updates, {**stats, **charts}, nets)
    return True


def finish(runs, step, updates, networks, evaluate, **fields):
    """Every seed's run finished, the lead's last; `evaluate(nets, args, run_name)`: one seed's."""
    for run, nets in reversed(list(zip(runs, networks))):
        run.finish(step, updates, nets, lambda run=run, nets=nets: evaluate(nets, run.args, run.name), **fields)
