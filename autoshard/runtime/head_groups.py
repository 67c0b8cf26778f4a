"""Attention with its projections, a head group at a time (``head_chunks``; found by :mod:`autoshard.passes.heads`).

At millions of tokens per step the largest values of a layer are the attention's inputs and outputs *outside*
the op: the query projection, the output, and in backward their gradients, ``[tokens, heads x head_dim]`` each
(8 GiB apiece for Llama-8B at 1M tokens per rank). Running the op a head group at a time (:mod:`.attention.
head_chunks`) shrinks only what lives inside it. UPipe's answer, for every strategy: the q/k/v projections, the
attention and the output projection of one key/value head group run together, so those values exist for one
group at a time outside the op as inside it. The output projection is then a sum over the groups of partial
products (what tensor parallelism's row-parallel projection computes).

:func:`grouped_attention` runs the region the pass cut out, a group at a time: the projections themselves
(``linear`` of the row input and the group's rows of each weight and bias), then two bodies over a group's heads:
``pre`` (the projections' outputs -> the group's ``q, k, v``: rotary embedding, per-head norms) and ``post`` (the
group's attention output and the output projection's columns of the group -> its partial product). Its autograd
(:class:`_GroupedAttention`) saves what one pass over the heads cannot recompute cheaply -- the attention's output
and log-sum-exp, one ``[tokens, heads x head_dim]`` value in all -- and the region's inputs (the layer's normalized
hidden state, which every group reads: one value); backward runs group by group: it recomputes the group's
projections (a matmul each), the output projection's backward gives the group's ``dout``, the attention's backward
op gives ``dq, dk, dv``, ``pre``'s backward the projections' output gradients, and those go into the input's
gradient with one ``addmm_`` per projection (no ``[tokens, hidden]`` temporary per group) and into the weights'
gradient rows. So the attention runs forward once and backward once (none recomputed), and in backward q, k, v,
dout, dq, dk, dv exist for one group.

Inside a checkpointed layer (``recompute="layers"``) the saved output is what the layer's recomputation saves;
the first forward saves it through the checkpoint's hooks (that is, not at all). The call is a Python function of
the rank graph: it runs with the eager inner compiler (as offload does; ``"auto"`` resolves to eager with head
groups).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["HeadGroups", "grouped_attention"]

WHOLE, ROWS, COLUMNS, FIRST = "whole", "rows", "columns", "first"
"""How a group reads an input: all of it (the row inputs, the rotary tables); its rows (a projection's weight
and bias: dim 0, one group's share); its columns (the output projection's weight: dim 1); only the first group
(the output projection's bias, added once)."""


@dataclass(frozen=True)
class HeadGroups:
    """How :func:`grouped_attention` reads its inputs."""

    groups: int
    """Head groups, each ``1 / groups`` of the query and of the key/value heads."""
    projections: tuple[tuple[int, int, int], ...]
    """``(input, weight, bias)`` indices of the call's inputs for each projection that starts ``pre`` (bias -1:
    none); ``pre`` takes their outputs first."""
    pre_inputs: tuple[int, ...]
    """Indices of the call's inputs that ``pre`` takes after the projections' outputs, in its order."""
    post_inputs: tuple[int, ...]
    """Indices of the call's inputs that ``post`` takes after the attention's output, in its order."""
    roles: tuple[str, ...]
    """Per input of the call: :data:`WHOLE`, :data:`ROWS`, :data:`COLUMNS` or :data:`FIRST`."""
    attention_args: tuple
    """The attention op's arguments after ``q, k, v`` (masks, score terms, its configuration), with ``head_chunks``
    1 (no gradient flows to them: masks, positions, sizes)."""


def _part(t, role: str, group: int, groups: int):
    if role == WHOLE or t is None:
        return t
    if role == FIRST:
        return t if group == 0 else None
    dim = 0 if role == ROWS else 1
    size = t.size(dim) // groups
    return t.narrow(dim, group * size, size)


class _GroupedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre: fx.GraphModule, post: fx.GraphModule, spec: HeadGroups, *inputs):
        device = next(t.device.type for t in inputs if isinstance(t, torch.Tensor))
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        result, outs, lses = None, [], []
        for g in range(spec.groups):
            part = functools.partial(_input, inputs, spec, g)
            projected = [F.linear(inputs[x], part(w), part(b)) for x, w, b in spec.projections]
            q, k, v = pre(*projected, *map(part, spec.pre_inputs))
            del projected
            out, lse = torch.ops.autoshard.attention.default(q, k, v, *spec.attention_args)
            del q, k, v
            y = post(out, *map(part, spec.post_inputs))
            result = y if result is None else result.add_(y)
            outs.append(out)
            lses.append(lse)
        tensors = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor)]
        ctx.save_for_backward(*(inputs[i] for i in tensors), *outs, *lses)
        ctx.layout = (pre, post, spec, tensors, [None if isinstance(t, torch.Tensor) else t for t in inputs])
        return result

    @staticmethod
    def backward(ctx, dy):
        pre, post, spec, tensors, constants = ctx.layout
        inputs = list(constants)  # a copy: the tensors written in must die with this call, not with ctx
        saved = ctx.saved_tensors
        for i, t in zip(tensors, saved):
            inputs[i] = t
        outs, lses = saved[len(tensors):len(tensors) + spec.groups], saved[len(tensors) + spec.groups:]
        wanted = {i for i in range(len(inputs)) if ctx.needs_input_grad[3 + i]}
        grads: list = [None] * len(inputs)
        device, enabled, dtype = ctx.autocast
        for g in range(spec.groups):
            part = functools.partial(_input, inputs, spec, g)
            leaves = {i: part(i) for i in (*spec.pre_inputs, *spec.post_inputs)}
            for i in wanted & leaves.keys():
                if leaves[i] is not None:
                    leaves[i] = leaves[i].detach().requires_grad_()
            out = outs[g].detach().requires_grad_()
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):  # as forward ran
                with torch.no_grad():
                    projected = [F.linear(inputs[x], part(w), part(b)) for x, w, b in spec.projections]
                projected = [p.requires_grad_() for p in projected]
                q, k, v = pre(*projected, *(leaves[i] for i in spec.pre_inputs))
                y = post(out, *(leaves[i] for i in spec.post_inputs))
            post_wanted = [i for i in dict.fromkeys(spec.post_inputs) if i in wanted and leaves[i] is not None]
            dout, *found = torch.autograd.grad(y, [out, *(leaves[i] for i in post_wanted)], dy)
            _collect(grads, inputs, spec, g, zip(post_wanted, found))
            del y, found
            dq, dk, dv, _ = torch.ops.autoshard.attention_backward.default(
                dout, q.detach(), k.detach(), v.detach(), outs[g], lses[g], *spec.attention_args)
            del dout
            pre_wanted = [i for i in dict.fromkeys(spec.pre_inputs) if i in wanted and leaves[i] is not None]
            found = torch.autograd.grad((q, k, v), [*projected, *(leaves[i] for i in pre_wanted)], (dq, dk, dv),
                                        allow_unused=True)
            del q, k, v, dq, dk, dv, projected
            d_projected, found = found[:len(spec.projections)], found[len(spec.projections):]
            _collect(grads, inputs, spec, g, zip(pre_wanted, found))
            del found
            with torch.autocast(device, dtype=dtype, enabled=enabled):
                for (x, w, b), d in zip(spec.projections, d_projected):
                    _projection_grads(grads, inputs, spec, g, wanted, x, w, b, d)
            del d_projected
        return (None, None, None, *grads)


def _projection_grads(grads: list, inputs, spec: HeadGroups, group: int, wanted: set, x: int, w: int, b: int,
                      d: torch.Tensor | None) -> None:
    """Add one group's share of a projection ``linear(inputs[x], inputs[w], inputs[b])`` to the gradients of its
    input (one matmul accumulated in place: no ``[tokens, hidden]`` temporary) and of its weight's and bias's rows,
    from the gradient ``d`` of the group's output."""
    if d is None:
        return
    d2 = d.flatten(0, -2)
    weight = _input(inputs, spec, group, w)
    if x in wanted:
        total = grads[x]
        if total is None:
            grads[x] = torch.mm(d2, weight.to(d2.dtype)).to(inputs[x].dtype).view(inputs[x].shape)
        elif total.dtype == d2.dtype == weight.dtype:
            total.view(-1, total.size(-1)).addmm_(d2, weight)
        else:  # autocast: the matmul in the dtype forward ran it in
            total.view(-1, total.size(-1)).add_(torch.mm(d2, weight.to(d2.dtype)))
    if w in wanted:
        grads[w] = grads[w] if grads[w] is not None else torch.zeros_like(inputs[w])
        rows = _part(grads[w], ROWS, group, spec.groups)
        x2 = inputs[x].flatten(0, -2)
        if rows.dtype == d2.dtype == x2.dtype:
            rows.addmm_(d2.t(), x2)
        else:
            rows.add_(torch.mm(d2.t(), x2.to(d2.dtype)))
    if b >= 0 and b in wanted:
        grads[b] = grads[b] if grads[b] is not None else torch.zeros_like(inputs[b])
        _part(grads[b], ROWS, group, spec.groups).add_(d2.sum(0))


def _input(inputs, spec: HeadGroups, group: int, i: int):
    """The call's input ``i`` as group ``group`` reads it (-1: None)."""
    return None if i < 0 else _part(inputs[i], spec.roles[i], group, spec.groups)


def _collect(grads: list, inputs, spec: HeadGroups, group: int, found) -> None:
    """Add one group's gradients ``found`` ((input index, gradient of the group's part) pairs) to ``grads``."""
    for i, grad in found:
        if grad is None:
            continue
        role = spec.roles[i]
        if role in (WHOLE, FIRST):
            grads[i] = grad if grads[i] is None else grads[i].add_(grad)
            continue
        if grads[i] is None:
            grads[i] = torch.zeros_like(inputs[i])
        _part(grads[i], role, group, spec.groups).add_(grad)


def grouped_attention(pre: fx.GraphModule, post: fx.GraphModule, groups: int, projections: tuple,
                      pre_inputs: tuple[int, ...], post_inputs: tuple[int, ...], roles: tuple[str, ...],
                      attention_args: tuple, *inputs):
    """The region ``pre -> attention -> post`` over every head group, summed (see the module docstring and
    :class:`HeadGroups` for the arguments)."""
    spec = HeadGroups(groups=groups, projections=projections, pre_inputs=pre_inputs, post_inputs=post_inputs,
                      roles=roles, attention_args=attention_args)
    return _GroupedAttention.apply(pre, post, spec, *inputs)
