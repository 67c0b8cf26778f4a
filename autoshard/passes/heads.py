"""Cut each attention out with its projections, to run a key/value head group at a time (``head_chunks`` > 1).

The runtime side is :mod:`autoshard.runtime.head_groups` (why: at millions of tokens the projections' values
outside the op are a layer's largest). This pass finds, in the per-rank graph after ``rewrite``, for every
distributed attention:

* **pre**: the nodes between the ``linear`` projections and the op's ``q, k, v`` -- every ancestor of ``q, k, v``
  that descends from a ``linear`` reached from them without crossing another (the projections themselves
  included): reshapes into heads, transposes, rotary embedding (its tables are read whole), per-head norms;
* **post**: the nodes from the op's output to the one ``linear`` that reads the heads merged into its last dim
  (the output projection), reshapes and transposes between.

Every such node must carry the heads along one dim, and where it spells a size, that size is rewritten for a
group. The rules follow the head dim (``hd``) from the projections' last dim to the op's dim 1 and back:

==============================  =====================================================================
op                              the head dim of its output; what a group rewrites
==============================  =====================================================================
``linear`` (a projection)       its last dim; its weight and bias are read a group's rows at a time
``view`` / ``reshape`` / ...    the output dim where the sizes before it multiply to the input's
                                (sympy expressions: a symbolic length never matches a head count);
                                a size spelled there is divided by the groups
``permute`` / ``transpose``     where the permutation takes it
``getitem`` (slices)            where the index takes it; the slice over it must be whole (rewritten)
``expand``                      the same dim, counted from the right; a size spelled there is divided
``cat``, ``reduce``, norms      the same dim (not the one concatenated or reduced)
pointwise, casts, copies        the same dim, counted from the right; every other operand broadcast over it
==============================  =====================================================================

A region is left whole (``ungrouped``, with the reason in ``ungrouped_reasons``) when a value inside it has a
user outside it (a KV cache returned), an op has no rule above (a fused QKV projection split in three), the
attention has per-head score terms (ALiBi slopes, a position bias, sinks) or dropout, or the heads allow fewer than
two groups: the key/value heads must divide into the groups, and a strategy that splits heads over ranks (Ulysses,
the hybrid) needs a query head per rank in each. Such a region's attention still runs its heads in groups inside
the op (:mod:`autoshard.runtime.attention.head_chunks`).

The pass runs after ``rewrite`` (the sizes are this rank's; the collectives inside the op are the strategy's) and
before ``tile`` (the norm before the projections is then a token-local region of its own). The new call and its
bodies carry the region of a checkpointed layer, so ``outline`` cuts them out with the layer. It runs with the eager
inner compiler only (the call is a Python autograd function): with another one the groups stay inside the op.
"""

from __future__ import annotations

import operator
from collections import Counter

import sympy
import torch
import torch.fx as fx

from ..runtime.attention.api import OpConfig
from ..runtime.attention.base import STRATEGIES
from ..runtime.head_groups import COLUMNS, FIRST, ROWS, WHOLE, grouped_attention
from ..runtime.symbolic import size_key
from .ops import is_tensor_node, op_of, permutation
from .regions import REGION, _fresh_attr
from .rewrite import Rewriter

__all__ = ["group_heads"]

_ATTENTION = torch.ops.autoshard.attention.default
_CONFIG_AT = 9
"""Where the op's :class:`OpConfig` arguments start (after q, k, v, the two masks and the four score terms)."""
_TERMS = slice(5, 8)
"""The per-head score terms (ALiBi slopes, a position bias, sinks): a region with any is left whole."""


class _Ungrouped(Exception):
    """Why a region is left whole."""


def _expr(size):
    key = size_key(size)
    return key[1] if isinstance(key, tuple) else sympy.Integer(key)


def _prefix(shape, end: int):
    return sympy.expand(sympy.Mul(*[_expr(s) for s in shape[:end]]))


def _dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


class _Heads:
    """The head dim of every value of one region, and the rewritten arguments of its nodes."""

    def __init__(self, shape: dict[fx.Node, tuple]):
        self.shape = shape
        self.groups = 1
        """The groups the sizes are divided into (set once the heads' count is read)."""
        self.hd: dict[fx.Node, int] = {}
        self.args: dict[fx.Node, tuple[tuple, dict]] = {}

    def global_shape(self, node: fx.Node) -> tuple:
        """``node``'s global shape: the original graph's, or its input's for a cast or copy the rewrite made (the
        dtype casts of autocast)."""
        if node not in self.shape:
            op = op_of(node)
            if op is None or op.name not in ("to", "identity") or not isinstance(op["input"], fx.Node):
                raise _Ungrouped(f"no shape for {node.name}")
            self.shape[node] = self.global_shape(op["input"])
        return self.shape[node]

    def divided(self, size, what: str):
        """``size`` (an int spelled in an argument) for a group."""
        if size == -1:
            return size
        if not isinstance(size, int) or size % self.groups:
            raise _Ungrouped(f"{what} of {size!r} does not divide into {self.groups} groups")
        return size // self.groups

    def follow(self, node: fx.Node) -> None:
        """Record the head dim of ``node`` (every input it reads with heads is recorded) and its arguments for a
        group."""
        op = op_of(node)
        name = op.name if op is not None else None
        rule = _RULES.get(name)
        if rule is None:
            raise _Ungrouped(f"{name or node.target} has no head rule")
        self.args[node] = (node.args, dict(node.kwargs))
        self.hd[node] = rule(self, node, op)

    def head_input(self, op) -> tuple[fx.Node, int]:
        x = op["input"]
        if x not in self.hd:
            raise _Ungrouped(f"{op.name} reads no head-carrying input")
        return x, self.hd[x]

    def set_size(self, node: fx.Node, position: int, offset: int = 1) -> None:
        """Divide the size at ``position`` of the sizes ``node`` spells from argument ``offset`` on (varargs or
        one tuple)."""
        args = list(node.args)
        if len(args) == offset + 1 and isinstance(args[offset], (tuple, list, torch.Size)):
            sizes = list(args[offset])
            sizes[position] = self.divided(sizes[position], node.name)
            args[offset] = type(args[offset])(sizes) if not isinstance(args[offset], torch.Size) else tuple(sizes)
        elif "size" in node.kwargs or "shape" in node.kwargs:
            key = "size" if "size" in node.kwargs else "shape"
            sizes = list(node.kwargs[key])
            sizes[position] = self.divided(sizes[position], node.name)
            self.args[node] = (tuple(args), {**node.kwargs, key: tuple(sizes)})
            return
        else:
            args[offset + position] = self.divided(args[offset + position], node.name)
        self.args[node] = (tuple(args), dict(node.kwargs))


def _linear(heads: _Heads, node: fx.Node, op) -> int:
    if op["input"] in heads.hd or op["weight"] in heads.hd:
        raise _Ungrouped(f"{node.name}: a projection of values with heads")
    return len(heads.global_shape(node)) - 1


def _view(heads: _Heads, node: fx.Node, op) -> int:
    x, d = heads.head_input(op)
    shape_in, shape_out = heads.global_shape(x), heads.global_shape(node)
    prefix = _prefix(shape_in, d)
    out = next((i for i in range(len(shape_out)) if _prefix(shape_out, i) == prefix and
                isinstance(shape_out[i], int) and shape_out[i] > 1), None)
    if out is None or shape_in[d] % heads.groups or shape_out[out] % heads.groups:
        raise _Ungrouped(f"{node.name}: the heads do not stay a leading dim of the view")
    method = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if method in ("view", "reshape"):
        heads.set_size(node, out)
    elif method == "unflatten":
        start = _dim(node.args[1] if len(node.args) > 1 else node.kwargs["dim"], len(shape_in))
        if start <= out < start + len(shape_out) - len(shape_in) + 1:
            heads.set_size(node, out - start, offset=2)
    elif method not in ("flatten", "squeeze", "unsqueeze"):
        raise _Ungrouped(f"{node.name}: {method} has no head rule")
    return out


def _permute(heads: _Heads, node: fx.Node, op) -> int:
    x, d = heads.head_input(op)
    return permutation(node, len(heads.global_shape(x))).index(d)


def _getitem(heads: _Heads, node: fx.Node, op) -> int:
    x, d = heads.head_input(op)
    shape_in = heads.global_shape(x)
    index = op["index"] if isinstance(op["index"], tuple) else (op["index"],)
    if any(isinstance(i, fx.Node) or i is Ellipsis for i in index):
        raise _Ungrouped(f"{node.name}: an index by tensor or ellipsis over heads")
    new, dim_in, dim_out, found = [], 0, 0, None
    for item in index:
        if item is None:
            new.append(item)
            dim_out += 1
            continue
        if dim_in == d:
            whole = isinstance(item, slice) and item.start in (None, 0) and item.step in (None, 1) and \
                (item.stop is None or (isinstance(item.stop, int) and item.stop >= shape_in[d]))
            if not whole:
                raise _Ungrouped(f"{node.name}: an index into the heads")
            item, found = slice(0, heads.divided(shape_in[d], node.name), 1), dim_out
        if not isinstance(item, slice):
            raise _Ungrouped(f"{node.name}: an index that drops a dim")
        new.append(item)
        dim_in += 1
        dim_out += 1
    if found is None:  # the heads' dim is past the index: whole
        found = dim_out + d - dim_in
    heads.args[node] = ((x, tuple(new) if isinstance(op["index"], tuple) else new[0]), {})
    return found


def _expand(heads: _Heads, node: fx.Node, op) -> int:
    x, d = heads.head_input(op)
    out = d + len(heads.global_shape(node)) - len(heads.global_shape(x))
    if node.target == "expand_as":
        raise _Ungrouped(f"{node.name}: expand_as a value with all heads")
    heads.set_size(node, out)
    return out


def _same(heads: _Heads, node: fx.Node, op) -> int:
    """The head dim counted from the right, every operand without heads broadcast over it."""
    ndim = len(heads.global_shape(node))
    from_right = {len(heads.global_shape(a)) - heads.hd[a] for a in node.all_input_nodes if a in heads.hd}
    if len(from_right) != 1:
        raise _Ungrouped(f"{node.name}: operands with heads along different dims")
    (right,) = from_right
    for a in node.all_input_nodes:
        if a not in heads.hd and is_tensor_node(a):
            shape = heads.global_shape(a)
            if len(shape) >= right and shape[len(shape) - right] != 1:
                raise _Ungrouped(f"{node.name}: {a.name} has heads but is not in the region")
    return ndim - right


def _cat(heads: _Heads, node: fx.Node, op) -> int:
    out = _same(heads, node, op)
    if _dim(op["dim"], len(heads.global_shape(node))) == out:
        raise _Ungrouped(f"{node.name}: concatenates heads")
    return out


def _reduce(heads: _Heads, node: fx.Node, op) -> int:
    x, d = heads.head_input(op)
    ndim = len(heads.global_shape(x))
    dims = op["dim"]
    dims = [dims] if isinstance(dims, int) else list(dims) if dims is not None else list(range(ndim))
    dims = [_dim(i, ndim) for i in dims]
    if d in dims:
        raise _Ungrouped(f"{node.name}: reduces over heads")
    return d if op["keepdim"] else d - sum(i < d for i in dims)


def _norm(heads: _Heads, node: fx.Node, op) -> int:
    x, d = heads.head_input(op)
    if d >= len(heads.global_shape(x)) - len(op["normalized_shape"]):
        raise _Ungrouped(f"{node.name}: normalizes over heads")
    return d


_RULES = {"linear": _linear, "view": _view, "permute": _permute, "getitem": _getitem, "tuple_get": _getitem,
          "expand": _expand, "pointwise": _same, "to": _same, "identity": _same, "cat": _cat, "reduce": _reduce,
          "rms_norm": _norm, "layer_norm": _norm}
"""Canonical op -> its head rule (the module docstring's table; ``tuple_get``: an index into a value the rank graph
carries no example of)."""


# ----------------------------------------------------------------------------- finding a region


def _pre(attention: fx.Node) -> list[fx.Node]:
    """The nodes from the projections to the op's q, k, v (see the module docstring), in graph order."""
    ancestors, linears, stack = set(), set(), list(attention.args[:3])
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in ancestors:
            continue
        ancestors.add(node)
        op = op_of(node)
        if op is not None and op.name == "linear":
            linears.add(node)
        elif node.op not in ("placeholder", "get_attr"):
            stack.extend(node.all_input_nodes)
    members: dict[fx.Node, None] = {}
    for node in attention.graph.nodes:  # graph order: a member's inputs come first
        if node in linears or (node in ancestors and any(a in members for a in node.all_input_nodes)):
            members[node] = None
    return list(members)


def _post(attention: fx.Node, heads: _Heads) -> tuple[fx.Node, list[fx.Node], fx.Node]:
    """(the op's output, the nodes from it to the output projection in graph order, the output projection)."""
    outputs = {user.args[1]: user for user in attention.users
               if user.target is operator.getitem and isinstance(user.args[1], int)}
    if len(outputs) != len(attention.users) or 0 not in outputs or (1 in outputs and outputs[1].users):
        raise _Ungrouped("the attention's log-sum-exp is read")
    out = outputs[0]
    heads.hd[out] = 1
    reached, ends, stack = set(), set(), list(out.users)
    while stack:
        node = stack.pop()
        if node in reached or node in ends:
            continue
        op = op_of(node)
        if op is not None and op.name == "linear" and (op["input"] in reached or op["input"] is out):
            ends.add(node)
            continue
        reached.add(node)
        stack.extend(node.users)
    if len(ends) != 1:
        raise _Ungrouped("not one output projection" if ends else "no output projection")
    (end,) = ends
    members = [n for n in attention.graph.nodes if n in reached]
    for node in members:
        heads.follow(node)
    x = op_of(end)["input"]
    if heads.hd.get(x) != len(heads.global_shape(x)) - 1:
        raise _Ungrouped(f"{end.name}: the output projection does not read the heads merged into its last dim")
    return out, members, end


def _outside_users(members: list[fx.Node], allowed: set[fx.Node]) -> fx.Node | None:
    inside = set(members) | allowed
    return next((m for m in members for user in m.users if user not in inside), None)


def _group_count(attention: fx.Node, heads: _Heads, requested: int, world: int) -> int:
    """The most groups, at most ``requested``, that divide the key/value heads evenly and leave a strategy that
    splits heads over ranks a query head per rank in each."""
    q, k = attention.args[0], attention.args[1]
    h, hkv = heads.global_shape(q)[1], heads.global_shape(k)[1]
    strategy = STRATEGIES[attention.args[_CONFIG_AT]]
    least = world if strategy.splits_heads else 1
    count = next((c for c in range(min(requested, hkv), 1, -1) if hkv % c == 0 and h // c >= least), 1)
    if count < 2:
        raise _Ungrouped(f"{h} query and {hkv} key/value heads allow no groups"
                         + (f" of {least} query heads (one per rank)" if least > 1 else ""))
    return count


def _inputs(members: list[fx.Node]) -> list[fx.Node]:
    inside = set(members)
    return list(dict.fromkeys(a for m in members for a in m.all_input_nodes if a not in inside))


def _body(gm: fx.GraphModule, members: list[fx.Node], heads: _Heads, inputs: list,
          outputs) -> tuple[fx.GraphModule, list[torch.SymInt]]:
    """``members`` as a graph of their own over ``inputs`` (its placeholders, in order), their arguments as a
    group spells them, returning ``outputs`` (one node or a tuple); and the symbolic sizes those arguments hold (a
    graph of a length class: this rank's length), each taken as a placeholder after ``inputs`` -- the caller passes
    them, and ``materialize`` computes them in the rank graph."""
    graph = fx.Graph()
    env = {x: graph.placeholder(x.name) for x in inputs}
    sizes: dict = {}  # size_key -> (the SymInt, its placeholder)

    def lifted(value):
        if isinstance(value, torch.SymInt):
            key = size_key(value)
            if key not in sizes:
                last = ([p for _, p in sizes.values()] or [env[x] for x in inputs] or [None])[-1]
                with graph.inserting_after(last) if last is not None else graph.inserting_before(None):
                    sizes[key] = (value, graph.placeholder(f"size_{len(sizes)}"))
            return sizes[key][1]
        if isinstance(value, slice):
            return slice(lifted(value.start), lifted(value.stop), lifted(value.step))
        if isinstance(value, (tuple, list)):
            return type(value)(lifted(v) for v in value)
        if isinstance(value, dict):
            return {k: lifted(v) for k, v in value.items()}
        return value

    for node in members:
        args, kwargs = heads.args.get(node, (node.args, node.kwargs))
        args, kwargs = lifted(args), lifted(kwargs)  # a new size's placeholder goes after the others
        new = graph.node_copy(node, env.__getitem__)
        own = {p for _, p in sizes.values()}  # the sizes' placeholders: already the body's
        find = lambda n: n if n in own else env[n]  # noqa: E731
        new.args, new.kwargs = fx.node.map_arg(args, find), fx.node.map_arg(kwargs, find)
        env[node] = new
    graph.output(tuple(env[y] for y in outputs) if isinstance(outputs, tuple) else env[outputs])
    return fx.GraphModule(gm, graph), [value for value, _ in sizes.values()]


def _key(x):
    """An input of a grouped call as a dict key: a node itself, a size by its expression (comparing ``SymInt``
    values would record a guard)."""
    return size_key(x) if isinstance(x, torch.SymInt) else x


def _group_one(gm: fx.GraphModule, attention: fx.Node, shape: dict, config, world: int, index: int) -> int:
    """Replace one attention region by a :func:`grouped_attention` call (returns its groups), or raise
    :class:`_Ungrouped`."""
    args = attention.args
    if any(t is not None for t in args[_TERMS]) or OpConfig(*args[_CONFIG_AT:]).dropout_p:
        raise _Ungrouped("per-head score terms or dropout")
    heads = _Heads(shape)
    heads.groups = _group_count(attention, heads, config.head_chunks, world)
    pre = _pre(attention)
    for node in pre:
        heads.follow(node)
    if any(heads.hd.get(t) != 1 for t in args[:3]):
        raise _Ungrouped("q, k, v do not carry heads along dim 1")
    out, post, end = _post(attention, heads)
    if _outside_users(pre, {attention}) or _outside_users(post, {end}):
        raise _Ungrouped("a value of the region is read outside it")
    if len({n.meta.get(REGION) for n in (*pre, attention, *post, end)}) != 1:
        raise _Ungrouped("the region straddles a checkpointed layer's edge")
    projections = [n for n in pre if op_of(n).name == "linear"]
    rest = [n for n in pre if n not in projections]
    roles: dict[fx.Node, str] = {}
    for node in projections:
        op = op_of(node)
        roles.update({w: ROWS for w in (op["weight"], op["bias"]) if isinstance(w, fx.Node)})
    end_op = op_of(end)
    roles[end_op["weight"]] = COLUMNS
    if isinstance(end_op["bias"], fx.Node):
        roles[end_op["bias"]] = FIRST
    for node in (*rest, *post, end):  # a weight read as anything else: not one group's rows
        op = op_of(node)
        if any(a in roles and not (node is end and a in (op["weight"], op["bias"])) for a in node.all_input_nodes):
            raise _Ungrouped(f"{node.name} reads a projection's weight")
    if any(op_of(n)["input"] in roles for n in projections):
        raise _Ungrouped("a projection of a projection's weight")
    pre_inputs = [a for a in _inputs(rest) if a not in projections]
    post_inputs = [a for a in _inputs([out, *post, end]) if a is not attention and a is not out]
    triples = [(op_of(n)["input"], op_of(n)["weight"], op_of(n)["bias"]) for n in projections]
    pre_body, pre_sizes = _body(gm, rest, heads, [*projections, *pre_inputs], tuple(args[:3]))
    post_body, post_sizes = _body(gm, [*post, end], heads, [out, *post_inputs], end)
    pre_inputs, post_inputs = [*pre_inputs, *pre_sizes], [*post_inputs, *post_sizes]
    position: dict = {}  # a node, or a size by its expression -> its place among the call's inputs
    inputs = []
    for x in (*(a for t in triples for a in t if isinstance(a, fx.Node)), *pre_inputs, *post_inputs):
        if _key(x) not in position:
            position[_key(x)] = len(inputs)
            inputs.append(x)
    attention_args = list(args[3:])
    attention_args[-1] = 1  # head_chunks: each call is one group
    names = [_fresh_attr(gm, pre_body, f"heads_pre_{index}"), _fresh_attr(gm, post_body, f"heads_post_{index}")]
    with gm.graph.inserting_before(end):
        getters = [gm.graph.get_attr(n) for n in names]
        call = gm.graph.call_function(grouped_attention, (
            *getters, heads.groups,
            tuple(tuple(position[a] if isinstance(a, fx.Node) else -1 for a in t) for t in triples),
            tuple(position[_key(x)] for x in pre_inputs), tuple(position[_key(x)] for x in post_inputs),
            tuple(roles.get(x, WHOLE) if isinstance(x, fx.Node) else WHOLE for x in inputs),
            tuple(attention_args), *inputs))
    region = attention.meta.get(REGION)
    for node in (*getters, call):
        if region is not None:
            node.meta[REGION] = region
    call.meta.update({k: v for k, v in attention.meta.items() if k in ("stack_trace", "nn_module_stack")})
    end.replace_all_uses_with(call)
    for node in reversed([*pre, attention, *attention.users, *post, end]):
        gm.graph.erase_node(node)
    return heads.groups


def group_heads(gm: fx.GraphModule, config, rewriter: Rewriter) -> dict:
    """Group the heads of every attention region of the per-rank graph ``gm`` (see the module docstring); counts:
    ``grouped_attentions``, ``head_groups`` (their calls' groups, summed), ``ungrouped_attentions`` and
    ``ungrouped_reasons`` (reason -> count)."""
    counts = {"grouped_attentions": 0, "head_groups": 0, "ungrouped_attentions": 0}
    if config.head_chunks <= 1 or config.inner not in ("eager", "auto"):
        return counts
    shape = rewriter.global_shapes(rewriter.originals())
    reasons: Counter = Counter()
    attentions = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _ATTENTION]
    for i, attention in enumerate(attentions):
        try:
            counts["head_groups"] += _group_one(gm, attention, shape, config, rewriter.world, i)
        except _Ungrouped as why:
            counts["ungrouped_attentions"] += 1
            reasons[str(why)] += 1
            continue
        counts["grouped_attentions"] += 1
    if counts["grouped_attentions"]:
        gm.graph.lint()
        gm.recompile()
    if reasons:
        counts["ungrouped_reasons"] = dict(reasons)
    return counts
