"""Dynamo's graph of a function, as a torch.compile backend receives it: what the pass unit tests run a pass on."""

from __future__ import annotations

import torch
import torch.fx as fx

__all__ = ["dynamo_graph"]


def dynamo_graph(fn, *inputs) -> fx.GraphModule:
    """The one graph dynamo captures of ``fn(*inputs)`` (``fullgraph=True``; dynamo's caches reset first)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*inputs)
    (gm,) = graphs
    return gm
