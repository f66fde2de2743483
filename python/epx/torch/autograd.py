"""Autograd of the custom ops, read from epx.semantics: an op's setup keeps
exactly what semantics.SAVES names, and its backward calls the ops that
semantics.BACKWARD pairs with it. An op's gradient rule (which gradient
goes to which backward op, and to which input) is the only code here per
op."""
from types import SimpleNamespace

import torch as _torch

from epx import semantics


def _holds(when, args):
    """Whether semantics condition `when` (None: always) holds for the inputs."""
    if when is None:
        return True
    w = args.get("topk_w")
    weighting = semantics.CONDITIONS[when]
    return (w is not None and w.requires_grad
            and (weighting is None or args["weighting"] == weighting))


def _attr(a, args):
    value = args[a.of]
    if a.dim is None:
        return value
    return a.default if value is None else value.shape[a.dim]


def _input_names(op):
    return tuple(arg.name for arg in op._opoverload._schema.arguments)


def _keep(ctx, name, names, inputs, output):
    """Keep on ctx what semantics.SAVES[name] names, from op name's inputs
    (its argument names `names`) and output: each condition as a flag on
    ctx, the values in ctx.attrs, the tensors saved for backward."""
    saves = semantics.SAVES[name]
    args = dict(zip(names, inputs))
    outputs = output if isinstance(output, tuple) else (output,)
    args.update(zip(semantics.OUTPUT_NAMES[name], outputs))
    for flag in saves.flags:
        setattr(ctx, flag, _holds(flag, args))
    ctx.attrs = {a.name: _attr(a, args) for a in saves.attrs}
    ctx.save_for_backward(*(args[t.name] if _holds(t.when, args) else None
                            for t in saves.tensors))


def _kept(ctx, name):
    """What _keep kept for op name, by name (a condition's tensor is None
    where it did not hold)."""
    tensors = (t.name for t in semantics.SAVES[name].tensors)
    return SimpleNamespace(**ctx.attrs, **dict(zip(tensors, ctx.saved_tensors)))


def _pair(name):
    """The backward ops semantics.BACKWARD pairs with op name, in order."""
    return tuple(getattr(_torch.ops.epx, n) for n in semantics.BACKWARD[name])


def _autograd(op, rule=None):
    """Register op's autograd from semantics.SAVES and semantics.BACKWARD.

    rule(ctx, saved, pair, *grads) -> {input name: gradient}: `saved` has
    the kept tensors and values by name (a condition's tensor is None where
    it did not hold; ctx has each flag), `pair` the backward ops in
    BACKWARD's order. An op without a rule has no gradient."""
    name = op._qualname.split("::")[1]
    names = _input_names(op)
    if (rule is None) != (not semantics.BACKWARD[name]):
        raise TypeError("epx::%s: a gradient rule goes with a backward pairing in "
                        "semantics.BACKWARD" % name)

    def setup(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        _keep(ctx, name, names, inputs, output)

    def backward(ctx, *grads):
        if rule is None:
            return (None,) * len(names)
        got = rule(ctx, _kept(ctx, name), _pair(name), *grads)
        return tuple(got.get(n) for n in names)

    op.register_autograd(backward, setup_context=setup if rule is not None else None)
