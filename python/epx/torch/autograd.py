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


def _autograd(op, rule=None):
    """Register op's autograd from semantics.SAVES and semantics.BACKWARD.

    rule(ctx, saved, pair, *grads) -> {input name: gradient}: `saved` has
    the kept tensors and values by name (a condition's tensor is None where
    it did not hold; ctx has each flag), `pair` the backward ops in
    BACKWARD's order. An op without a rule has no gradient."""
    name = op._qualname.split("::")[1]
    saves = semantics.SAVES[name]
    names = _input_names(op)
    outputs = semantics.OUTPUT_NAMES[name]
    if (rule is None) != (not semantics.BACKWARD[name]):
        raise TypeError("epx::%s: a gradient rule goes with a backward pairing in "
                        "semantics.BACKWARD" % name)

    def setup(ctx, inputs, output):
        args = dict(zip(names, inputs))
        args.update(zip(outputs, output if isinstance(output, tuple) else (output,)))
        ctx.set_materialize_grads(False)
        for flag in saves.flags:
            setattr(ctx, flag, _holds(flag, args))
        ctx.attrs = {a.name: _attr(a, args) for a in saves.attrs}
        ctx.save_for_backward(*(args[t.name] if _holds(t.when, args) else None
                                for t in saves.tensors))

    def backward(ctx, *grads):
        if rule is None:
            return (None,) * len(names)
        saved = SimpleNamespace(**ctx.attrs, **dict(zip((t.name for t in saves.tensors),
                                                        ctx.saved_tensors)))
        pair = tuple(getattr(_torch.ops.epx, n) for n in semantics.BACKWARD[name])
        got = rule(ctx, saved, pair, *grads)
        return tuple(got.get(n) for n in names)

    op.register_autograd(backward, setup_context=setup if rule is not None else None)
