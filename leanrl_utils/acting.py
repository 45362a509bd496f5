"""Acting on the host: a module's forward in numpy for stacked seeds, read from the module's own
layers and checked against its forward (or refused in one line), and a device policy called with
host arrays."""

import operator

import numpy as np
import torch
import torch.fx
import torch.nn as nn
import torch.nn.functional as F

from leanrl_utils.checks import fail


def numpy_layer(layer, name, p):
    """One layer as a numpy function on [seeds, rows, features], on views of its stacked weights."""
    if isinstance(layer, nn.Linear):
        weight_t = p[f"{name}.weight"].numpy().swapaxes(1, 2)
        bias = p[f"{name}.bias"].numpy()[:, None] if layer.bias is not None else np.float32(0)

        def linear(x):
            x = x @ weight_t
            x += bias
            return x

        return linear
    if isinstance(layer, nn.LayerNorm) and len(layer.normalized_shape) == 1:
        # Each row's mean and variance as a matmul with a column of 1/n: numpy's row reductions
        # cost several us each for a few rows.
        mean = np.full((layer.normalized_shape[0], 1), 1.0 / layer.normalized_shape[0], np.float32)
        affine = layer.elementwise_affine
        scale, shift = (p[f"{name}.{k}"].numpy()[:, None] if affine else np.float32(k == "weight") for k in ("weight", "bias"))

        def layer_norm(x):  # in place, as every layer after the first (see numpy_forward)
            x -= x @ mean
            std = (x * x) @ mean
            std += layer.eps
            np.sqrt(std, out=std)
            x /= std
            x *= scale
            x += shift
            return x

        return layer_norm
    activations = {
        nn.ReLU: lambda x: np.maximum(x, 0, out=x),  # in place: x is never the caller's (see forward)
        nn.Tanh: lambda x: np.tanh(x, out=x),
        nn.Sigmoid: lambda x: 1 / (1 + np.exp(-x)),
        nn.Identity: lambda x: x,
        nn.SiLU: lambda x: x / (1 + np.exp(-x)),
    }
    if type(layer) in activations:
        return activations[type(layer)]
    if isinstance(layer, nn.LeakyReLU):
        return lambda x: np.where(x > 0, x, x * layer.negative_slope)
    if isinstance(layer, nn.ELU):
        return lambda x: np.where(x > 0, x, layer.alpha * np.expm1(np.minimum(x, 0)))
    return None


# Functions and tensor methods a forward may call, as numpy functions on [seeds, rows, ...] arrays.
FUNCTIONS = {
    **{f: f for f in (operator.add, operator.sub, operator.mul, operator.truediv, operator.neg, operator.getitem)},
    torch.tanh: np.tanh, torch.exp: np.exp, torch.sigmoid: lambda x: 1 / (1 + np.exp(-x)),
    torch.relu: lambda x: np.maximum(x, 0), F.relu: lambda x: np.maximum(x, 0),
}  # fmt: skip
METHODS = {"exp": np.exp, "tanh": np.tanh, "expand_as": None, "flatten": None}
IN_PLACE = (nn.LayerNorm, nn.ReLU, nn.Tanh)  # forms that write their input (see numpy_layer)


def getitem(x, index):
    """x[index] as the module indexes one seed's rows: an array's index skips the seeds' dimension."""
    if not isinstance(x, np.ndarray):
        return x[index]
    return x[(slice(None), *(index if isinstance(index, tuple) else (index,)))]


def expand_as(x, y):
    """Tensor.expand_as as a copy: a few us less than np.broadcast_to's view, per call."""
    out = np.empty(y.shape, x.dtype)
    out[...] = x
    return out


def flatten(x, start_dim=0, end_dim=-1):
    """Tensor.flatten on one seed's rows, for the stacked seeds (the seeds' dimension kept)."""
    start = start_dim + 1 if start_dim >= 0 else x.ndim + start_dim
    end = end_dim + 1 if end_dim >= 0 else x.ndim + end_dim
    return x.reshape(*x.shape[:start], -1, *x.shape[end + 1 :])


def numpy_forward(module, params, prefix=""):
    """`module`'s forward (traced by torch.fx) as numpy code over stacked seeds, [seeds, rows, ...]:
    its layers on views of `params` (stacked CPU tensors, names under `prefix`: every optimizer step
    is seen), its ops as numpy's (under a microsecond where torch's cost several). A layer or op with
    no numpy form, or a mismatch on a probe, ends the run in one line."""
    name, forms = type(module).__name__, {}
    try:
        graph, error = torch.fx.symbolic_trace(module).graph, None
    except Exception as e:  # fx raises many types for control flow on values
        graph, error = None, e
    # First the layers, in the order the forward calls them: a missing numpy form is named.
    called = [node.target for node in graph.nodes if node.op == "call_module"] if graph else []
    leaves = [leaf for leaf, layer in module.named_modules() if leaf and next(layer.children(), None) is None]
    for leaf in dict.fromkeys(called + leaves):
        layer = module.get_submodule(leaf)
        forms[leaf] = numpy_layer(layer, prefix + leaf, params)
        if forms[leaf] is None:
            known = "Linear, LayerNorm, ReLU, Tanh, Sigmoid, SiLU, ELU, LeakyReLU"
            kind = f"{prefix + leaf} ({type(layer).__name__}) of {name}"
            fail(f"numpy acting cannot follow layer {kind}: use {known}, or give it a numpy form in leanrl_utils/acting.py")
    if error is not None:
        fail(f"numpy acting cannot trace {name}.forward ({type(error).__name__}): write it without branches on tensor values")
    # The forward as Python source over numpy functions (as torch.fx writes a GraphModule's): a
    # generated line per op costs what a written one does, where interpreting the graph cost twice.
    names, namespace, lines = {}, {}, []

    def expr(arg):
        if isinstance(arg, torch.fx.Node):
            return names[arg]
        if isinstance(arg, (tuple, list)):
            return f"({''.join(expr(a) + ', ' for a in arg)})"
        namespace[f"c{len(namespace)}"] = arg
        return f"c{len(namespace) - 1}"

    for node in graph.nodes:
        names[node] = f"v{len(names)}"
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":  # a parameter: a view of its stacked tensor
            namespace[names[node]] = params[prefix + node.target].numpy()
            continue
        if node.op == "output":
            lines.append(f"return {expr(node.args[0])}")
            break
        copy = False
        if node.op == "call_module":
            layer, fn = module.get_submodule(node.target), forms[node.target]
            # A layer that writes its input gets a copy where that input is the caller's or used again.
            source = node.args[0]
            copy = isinstance(layer, IN_PLACE) and (source.op in ("placeholder", "get_attr") or len(source.users) > 1)
        elif node.op == "call_function" and node.target in FUNCTIONS:
            fn = getitem if node.target is operator.getitem else FUNCTIONS[node.target]
        elif node.op == "call_method" and node.target in METHODS:
            fn = {"flatten": flatten, "expand_as": expand_as}.get(node.target) or METHODS[node.target]
        else:
            op = getattr(node.target, "__name__", node.target)
            fail(f"numpy acting cannot follow {op} in {name}.forward: use layers, arithmetic, {', '.join(METHODS)}")
        namespace[f"f{len(lines)}"] = fn
        args = [expr(a) for a in node.args] + [f"{k}={expr(v)}" for k, v in node.kwargs.items()]
        if copy:
            args[0] += ".copy()"
        lines.append(f"{names[node]} = f{len(lines)}({', '.join(args)})")
    inputs = [names[n] for n in graph.nodes if n.op == "placeholder"]
    exec(f"def forward({', '.join(inputs)}):\n" + "".join(f"    {line}\n" for line in lines), namespace)
    forward = namespace["forward"]

    # The probe: seed 0 of the derived forward against the module with seed 0's weights.
    seed0 = {k[len(prefix) :]: t[0] for k, t in params.items() if k.startswith(prefix)}
    first = next((m for m in module.modules() if isinstance(m, nn.Linear)), None)
    if first is None:
        fail(f"numpy acting needs a Linear layer in {name}: add one")
    probe = torch.randn(8, first.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = torch.func.functional_call(module, seed0, (probe,))
    n_seeds = next(iter(params.values())).shape[0]
    got = forward(np.broadcast_to(probe.numpy(), (n_seeds, *probe.shape)).copy())
    expected, got = (x if isinstance(x, tuple) else (x,) for x in (expected, got))
    if len(got) != len(expected) or not all(
        g[0].shape == e.shape and np.allclose(g[0], e.numpy(), rtol=1e-4, atol=1e-5) for g, e in zip(got, expected)
    ):
        fail(f"numpy acting does not match {name}.forward on a probe: give its ops a numpy form in leanrl_utils/acting.py")
    return forward


def host_arrays(policy, device):
    """A device policy as the loop calls it: host observations in, host arrays out."""

    def call(obs):
        # note: .cpu() is a CPU-GPU sync point on CUDA, which the host env needs anyway
        out = policy(torch.from_numpy(obs).to(device))
        return out.cpu().numpy() if isinstance(out, torch.Tensor) else [x.cpu().numpy() for x in out]

    return call
