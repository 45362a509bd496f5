"""What a run must restore to go on exactly (modules, optimizers, replay buffers, envs and their
random generators, the random streams), in the types a `weights_only` checkpoint holds."""

import inspect
import random
from collections import deque

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

from leanrl_utils.optimizers import Adam

SKIP = object()
CONTAINERS = {"__tuple__": tuple, "__list__": list, "__deque__": deque}


def to_plain(x):
    """`x` in the types a weights_only checkpoint holds (tensors, plain types), or SKIP."""
    if isinstance(x, np.generic):  # before float: np.float64 is one
        return x.item()
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)
    if isinstance(x, np.ndarray):
        if x.dtype == object:
            return SKIP
        kind = x.dtype.str  # uint32 and others torch cannot hold travel as int64
        return {"__ndarray__": torch.from_numpy(x.astype(np.int64) if x.dtype.kind == "u" else x.copy()), "dtype": kind}
    if isinstance(x, np.random.Generator):
        return {"__generator__": x.bit_generator.state}
    if isinstance(x, (tuple, list, deque)):
        items = [to_plain(v) for v in x]
        kind = next(k for k, t in CONTAINERS.items() if isinstance(x, t))
        return SKIP if any(v is SKIP for v in items) else {kind: items, "maxlen": getattr(x, "maxlen", None)}
    if isinstance(x, dict):
        items = {k: to_plain(v) for k, v in x.items()}
        return SKIP if any(v is SKIP or not isinstance(k, (str, int)) for k, v in items.items()) else {"__dict__": items}
    return SKIP


def from_plain(x, device=None):
    """The inverse of `to_plain`; tensors go to `device`."""
    if isinstance(x, torch.Tensor):
        return x.to(device) if device is not None else x
    if not isinstance(x, dict):
        return x
    if "__ndarray__" in x:
        return x["__ndarray__"].numpy().astype(np.dtype(x["dtype"]))
    if "__generator__" in x:
        generator = np.random.Generator(getattr(np.random, x["__generator__"]["bit_generator"])())
        generator.bit_generator.state = x["__generator__"]
        return generator
    if "__dict__" in x:
        return {k: from_plain(v, device) for k, v in x["__dict__"].items()}
    kind, items = next(iter(x.items()))
    items = [from_plain(v, device) for v in items]
    return deque(items, maxlen=x["maxlen"]) if kind == "__deque__" else CONTAINERS[kind](items)


def state_of(obj):
    """What a run needs of `obj` to go on exactly: a state_dict, a TensorDict's tensors, an env's
    layers, the generators a function closes over, or plain attributes (a buffer's filled rows)."""
    if isinstance(obj, torch.Tensor):  # a value updated in place (SAC's alpha)
        return {"tensor": obj.detach().cpu().clone()}
    if hasattr(obj, "flatten_keys"):  # a TensorDict of stacked parameters
        return {"tensors": {k: v.detach().cpu().clone() for k, v in obj.flatten_keys(".").items()}}
    if isinstance(obj, np.random.Generator):
        return {"generator": obj.bit_generator.state}
    if callable(obj) and not isinstance(obj, nn.Module):
        return {"closure": [g.bit_generator.state for g in closure_generators(obj)]}
    if isinstance(obj, (nn.Module, torch.optim.Optimizer, Adam)):  # another object's state_dict may be partial
        return {"state_dict": obj.state_dict()}
    if isinstance(obj, (gym.Env, gym.vector.VectorEnv)):
        return {"layers": [layer_state(layer) for layer in env_layers(obj)]}
    if hasattr(obj, "flush"):
        obj.flush()  # staged rows go to the storage first
    size, rows = getattr(obj, "size", None), getattr(obj, "buffer_size", None)
    state = {}
    for name, value in vars(obj).items():
        if isinstance(value, dict) and name == "stage":
            continue
        if isinstance(value, dict) and all(isinstance(v, torch.Tensor) for v in value.values()):
            value = {k: v[:size] if rows and len(v) == rows else v for k, v in value.items()}
        elif rows and isinstance(value, (np.ndarray, torch.Tensor)) and value.ndim and len(value) == rows:
            value = value[:size]  # only the filled rows
        if (plain := to_plain(value)) is not SKIP:
            state[name] = plain
    return {"attributes": state}


def restore(obj, state):
    """The inverse of `state_of`, in place: views of `obj` (a seed's part, a graph's input) see it."""
    if "tensor" in state:
        obj.detach().copy_(state["tensor"])
    elif "generator" in state:
        obj.bit_generator.state = state["generator"]
    elif "closure" in state:
        for generator, saved in zip(closure_generators(obj), state["closure"], strict=True):
            generator.bit_generator.state = saved
    elif "state_dict" in state:
        obj.load_state_dict(state["state_dict"])
    elif "tensors" in state:
        for k, v in obj.flatten_keys(".").items():
            v.detach().copy_(state["tensors"][k])
    elif "layers" in state:
        for layer, saved in zip(env_layers(obj), state["layers"]):
            restore_layer(layer, saved)
    else:
        for name, saved in state["attributes"].items():
            value, current = from_plain(saved), getattr(obj, name)
            if isinstance(current, dict) and isinstance(value, dict):
                for k, v in value.items():
                    current[k][: len(v)].copy_(v.to(current[k].device)) if isinstance(v, torch.Tensor) else None
            elif isinstance(current, (np.ndarray, torch.Tensor)) and current.ndim and len(value) <= len(current):
                current[: len(value)] = value if isinstance(current, np.ndarray) else value.to(current.device)
            else:
                setattr(obj, name, value if not isinstance(current, torch.Tensor) else value.to(current.device))


def closure_generators(fn):
    """The numpy generators a function closes over (a compiled one: those of the function it wraps)."""
    cells = getattr(inspect.unwrap(fn), "__closure__", None) or ()
    return [c.cell_contents for c in cells if isinstance(c.cell_contents, np.random.Generator)]


def env_layers(env):
    """A (vector) env's layers, outside in: each wrapper, then the sub-envs' layers."""
    layers = []
    while env is not None:
        layers.append(env)
        for sub in getattr(env, "envs", None) or []:
            layers.extend(env_layers(sub))
        env = getattr(env, "env", None)
    return layers


def layer_state(layer):
    """A layer's plain attributes, spaces' generators, running statistics and MuJoCo state."""
    state = {k: p for k, v in vars(layer).items() if k not in ("env", "envs") and (p := to_plain(v)) is not SKIP}
    for k, v in vars(layer).items():
        if isinstance(v, gym.spaces.Space):
            state[f"__space__{k}"] = v.np_random.bit_generator.state
        elif k not in state and type(v).__name__ == "RunningMeanStd":
            state[f"__stats__{k}"] = {name: to_plain(x) for name, x in vars(v).items()}
    if hasattr(layer, "data") and hasattr(layer, "model") and type(layer.data).__name__ == "MjData":
        import mujoco

        spec = mujoco.mjtState.mjSTATE_INTEGRATION
        buf = np.empty(mujoco.mj_stateSize(layer.model, spec))
        mujoco.mj_getState(layer.model, layer.data, buf, spec)
        state["__mujoco__"] = torch.from_numpy(buf)
    return state


def restore_layer(layer, state):
    for k, v in state.items():
        if k == "__mujoco__":
            import mujoco

            mujoco.mj_setState(layer.model, layer.data, v.numpy(), mujoco.mjtState.mjSTATE_INTEGRATION)
            mujoco.mj_forward(layer.model, layer.data)
        elif k.startswith("__space__"):
            getattr(layer, k.removeprefix("__space__")).np_random.bit_generator.state = v
        elif k.startswith("__stats__"):
            for name, x in v.items():
                setattr(getattr(layer, k.removeprefix("__stats__")), name, from_plain(x))
        else:
            setattr(layer, k, from_plain(v))


def random_state():
    state = {"torch": torch.get_rng_state(), "numpy": to_plain(np.random.get_state()), "python": to_plain(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_random_state(state):
    torch.set_rng_state(state["torch"])
    np.random.set_state(from_plain(state["numpy"]))
    random.setstate(from_plain(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
