"""Offloaded checkpoints (:mod:`autoshard.runtime.offload`): the saved-tensor hooks around a region, one process.

* With every non-parameter moved (as on an accelerator; on CPU inputs are already in host memory and stay): a value
  two regions take is copied once, a view of a parameter not at all; gradients exact.
* Prefetch (``prefetch``): backward's first use of a region's input starts its copy back, then the previous
  region's, before using its own; without, each comes back when used; no copy outlives the backward.
* A saved input someone still holds comes back as itself (no copy back); written in place after it was saved,
  backward raises (as autograd's own check would).
* On CUDA (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs it): pinned host copies on a copy stream of their own,
  gradients exact, and the prefetch holding the next region's input during a region's backward.
(The backend's ``offload=True`` on real models: ``tests/e2e/test_recompute.py``; the plan's bytes and copy time:
``tests/plan/test_plan_memory.py``.)
"""

import functools
import weakref

import pytest
import torch

from autoshard.runtime import offload
from autoshard.runtime.offload import offloaded_checkpoint


def _tanh_matmul() -> torch.fx.GraphModule:
    """A region's body: ``(tanh(x @ w),)``."""
    graph = torch.fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output((graph.call_function(torch.tanh, (graph.call_function(torch.matmul, (x, w)),)),))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _counted_host_copies(monkeypatch) -> list:
    """Every non-parameter moved (as on an accelerator); the shapes of the host copies made, in order."""
    monkeypatch.setattr(offload, "_HOST_DEVICE", "none: every tensor moves")
    copies = []

    class Counted(offload.HostCopy):
        def __init__(self, t):
            copies.append(t.shape)
            super().__init__(t)

    monkeypatch.setattr(offload, "HostCopy", Counted)
    return copies


def _leaves():
    """A weight and an input, float64, requiring grad."""
    return (torch.randn(4, 4, dtype=torch.float64, requires_grad=True),
            torch.randn(3, 4, dtype=torch.float64, requires_grad=True))


def test_host_copies(monkeypatch):
    """The hooks of an offloaded checkpoint, with every non-parameter moved (as on an accelerator): the region's
    input is copied once even when two regions take it, a view of a parameter (a gradient-sync wrapper's) is not
    copied, gradients are exact."""
    copies = _counted_host_copies(monkeypatch)
    w, x0 = _leaves()
    body = _tanh_matmul()

    def step(run):
        x = x0 * 2  # not a leaf: offloaded
        a = run(body, x, w)[0]
        b = run(body, x, w.view_as(w))[0]  # the same input again: one copy; the parameter's view stays
        return torch.autograd.grad((a * b).sum(), (x0, w))

    want = step(lambda f, *args: f(*args))
    got = step(offloaded_checkpoint)
    assert copies == [torch.Size([3, 4])], copies
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_a_held_input_comes_back_as_itself_and_a_written_one_raises(monkeypatch):
    """A region's input the caller still holds at backward is used as it is (its host copy is not brought back);
    written in place after the region saved it, backward raises."""
    monkeypatch.setattr(offload, "_HOST_DEVICE", "none: every tensor moves")
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    body = _tanh_matmul()
    x = x0 * 2
    out = offloaded_checkpoint(body, x, w)[0]
    got = torch.autograd.grad(out.sum(), (x0, w), retain_graph=True)
    want = torch.autograd.grad(body(x0 * 2, w)[0].sum(), (x0, w))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert offload._copied[id(x)][1].restored is None  # held: never copied back
    with torch.no_grad():
        x.mul_(3)
    with pytest.raises(RuntimeError, match="modified by an inplace operation after it was saved"):
        torch.autograd.grad(out.sum(), (x0, w))


@pytest.mark.parametrize("prefetch", [True, False])
def test_backward_prefetches_the_next_region(monkeypatch, prefetch):
    """Three offloaded regions in a chain, every input moved: with ``prefetch`` backward's first use of a region's
    input starts its own copy back, then the previous region's, before using its own; without, each comes back
    when it is used. Gradients exact either way, and no copy outlives the backward."""
    monkeypatch.setattr(offload, "_HOST_DEVICE", "none: every tensor moves")
    log, made = [], []

    class Logged(offload.HostCopy):
        def __init__(self, t):
            super().__init__(t)
            self.index = len(made)
            made.append(weakref.ref(self))

        def prefetch(self):
            if self.restored is None:
                log.append(("copy back", self.index))
            super().prefetch()

        def restore(self, keep=True):
            log.append(("use", self.index))
            return super().restore(keep)

    monkeypatch.setattr(offload, "HostCopy", Logged)
    body = _tanh_matmul()
    w = torch.randn(4, 4, dtype=torch.float64, requires_grad=True)
    x0 = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)

    def step(run):
        h = x0 * 2
        for _ in range(3):
            h = run(body, h, w)[0]
        return torch.autograd.grad(h.sum(), (x0, w))

    want = step(lambda f, *args: f(*args))
    got = step(functools.partial(offloaded_checkpoint, prefetch=prefetch))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    if prefetch:
        # its own copy first (the copy stream runs them in order), then the next region's
        assert log == [("copy back", 2), ("copy back", 1), ("use", 2), ("copy back", 0), ("use", 1), ("use", 0)], log
    else:
        assert log == [("use", 2), ("copy back", 2), ("use", 1), ("copy back", 1), ("use", 0), ("copy back", 0)], log
    assert [ref() for ref in made] == [None] * 3


def test_a_rebuilt_input_comes_from_the_region_before(monkeypatch):
    """Four regions in a chain, every input moved, the third with ``rebuild``: its input (the second region's
    output) gets no host copy; backward computes it again from the second region's input -- one more run of the
    second region's body, no grad -- and that input's device copy does not outlive the rebuild. Gradients exact."""
    copies, runs = _counted_host_copies(monkeypatch), []
    w, x0 = _leaves()
    bodies = [_tanh_matmul() for _ in range(4)]
    for i, body in enumerate(bodies):  # a direct call of a body: the rebuild's
        body.register_forward_pre_hook(lambda module, args, i=i: runs.append((i, torch.is_grad_enabled())))

    def step(run):
        h = x0 * 2
        for i, body in enumerate(bodies):
            h = run(body, h, w, rebuild=i == 2)[0]
        return torch.autograd.grad(h.sum(), (x0, w))

    want = step(lambda f, *args, rebuild: f(*args))
    runs.clear()
    got = step(functools.partial(offloaded_checkpoint, prefetch=False))
    for g, e in zip(got, want):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    assert len(copies) == 3, copies  # the inputs of regions 0, 1 and 3; region 2's is rebuilt
    assert runs == [(1, False)], runs  # the checkpoints run their bodies through an interpreter: no hook
    assert all(c is None or c.restored is None for _, c in offload._copied.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams and pinned memory")
def test_offload_on_cuda():
    """A chain of four regions on CUDA, each input 64 MiB: gradients exact with and without prefetch, the host
    copies pinned and made on the copy stream; with prefetch backward's peak holds one more region input."""
    device = torch.device("cuda")
    rows, width = 4096, 4096
    w = torch.randn(width, width, device=device, requires_grad=True)
    x0 = torch.randn(rows, width, device=device, requires_grad=True)
    body = _tanh_matmul()

    def step(run):
        h = x0 * 2
        for _ in range(4):
            h = run(body, h, w)[0]
        loss = h.sum()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        grads = torch.autograd.grad(loss, (x0, w))
        torch.cuda.synchronize()
        return grads, torch.cuda.max_memory_allocated() - start

    want, _ = step(lambda f, *args: f(*args))
    peaks = {}
    for prefetch in (True, False):
        grads, peaks[prefetch] = step(functools.partial(offloaded_checkpoint, prefetch=prefetch))
        for g, e in zip(grads, want):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)
    assert device in offload._streams
    copy = offload.HostCopy(x0.detach())
    assert copy.host.is_pinned()
    torch.testing.assert_close(copy.restore(), x0.detach())
    one_input = rows * width * 4
    assert peaks[True] - peaks[False] >= one_input * 0.9, (peaks, one_input)
