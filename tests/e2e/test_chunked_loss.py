"""The LM head and its cross-entropy chunked over tokens (``BackendConfig.chunk_loss``), against one process.

A small causal LM (embedding, two SDPA ``is_causal`` layers, RMSNorm, an ``lm_head`` Linear) ends in one
loss spelling per case, every one with shifted labels and ``ignore_index=-100`` on some of them:

* ``mean`` -- transformers' ``ForCausalLMLoss``: ``logits.float()``, labels padded with -100 and shifted,
  ``cross_entropy(logits.view(-1, V), labels.view(-1))``;
* ``slice`` -- Llama-1's ``logits[:, :-1].reshape(-1, V)`` against ``labels[:, 1:]`` (the slice of the
  logits moves onto the head's input);
* ``smoothing`` -- ``label_smoothing=0.1``, a head with a bias;
* ``sum`` -- ``reduction="sum"`` divided by a count (``num_items_in_batch``), no upcast;
* ``weight`` -- class weights;
* ``none`` -- ``reduction="none"``: the per-token losses (split, gathered for the comparison);
* ``returned`` -- ``mean``, and the logits returned too (as transformers' ``*ForCausalLM`` return them): the
  head stays for them, the loss is chunked all the same, and the objective's gradient reaches the head
  through both;
* ``bf16`` / ``bf16_sum`` -- ``mean`` and ``sum`` with bfloat16 parameters;
* ``aot_eager`` -- ``smoothing`` through the ``aot_eager`` inner compiler (the op and its backward op traced
  as opaque calls);
* ``autocast`` -- ``mean`` with float32 parameters under ``torch.autocast(bfloat16)``: the head's inputs cast
  to bfloat16 as autocast's linear casts them, the loss in float32.

Length 61 (neither world size divides it), batch 2, ``chunk_loss=16``: several chunks per rank, the same
count on every rank. Checked at 2 and 4 ranks: loss and every parameter gradient within 1e-9 (float64) or
``BF16_TOL`` (bfloat16 and autocast, relative to each tensor's largest magnitude; the worst measured is
9.8e-3, the gradient shares summed over ranks in bfloat16 as in ``test_mixed_precision``), 0 fallbacks, the chunking
pass counted the loss, the graph holds ``linear_cross_entropy`` and neither the head's ``[tokens, V]``
output nor ``cross_entropy``, and the bytes booked equal the bytes sent.

Memory (counted, not timed): with a 4096-class head and batch 32, the largest value any ATen op allocates
during the compiled forward and backward (the legacy profiler's per-op ``cpu_memory_usage``) is below a
third of this rank's ``[tokens, V]`` logits (15-31 MiB) with chunking -- measured: 2.1 MB, the parameters'
gradient bucket, a chunk's values being 0.5 MiB -- and at least their size without it.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.runtime import comm_counter
from autoshard.runtime.chunked_loss import linear_cross_entropy
from autoshard.testing import run_on_ranks
from autoshard.testing.equivalence import compare_with_one_process

HIDDEN, HEADS, VOCAB, LAYERS, SEQ, BATCH, CHUNK = 32, 4, 64, 2, 61, 2, 16
BF16_TOL = 5e-2


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.qkv, self.out = nn.RMSNorm(HIDDEN), nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (z.view(b, s, HEADS, -1).transpose(1, 2) for z in self.qkv(self.norm(x)).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).reshape(b, s, HIDDEN))


class TinyLM(nn.Module):
    def __init__(self, loss: str, vocab: int = VOCAB):
        super().__init__()
        self.loss, self.vocab = loss, vocab
        self.embed = nn.Embedding(vocab, HIDDEN)
        self.layers = nn.ModuleList(Layer() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, vocab, bias=loss == "smoothing")
        self.register_buffer("class_weight", torch.rand(vocab) + 0.5)

    def forward(self, ids, labels):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        logits = head = self.lm_head(self.norm(x))
        v = self.vocab
        if self.loss == "slice":
            return F.cross_entropy(logits[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1))
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous().view(-1)
        if self.loss in ("sum", "bf16_sum"):
            return F.cross_entropy(logits.view(-1, v), shifted, ignore_index=-100, reduction="sum") / 100.0
        logits = logits.float() if logits.dtype != torch.float64 else logits  # transformers' upcast (not down)
        if self.loss == "smoothing":
            return F.cross_entropy(logits.view(-1, v), shifted, ignore_index=-100, label_smoothing=0.1)
        if self.loss == "weight":
            return F.cross_entropy(logits.view(-1, v), shifted, weight=self.class_weight.to(logits.dtype),
                                   ignore_index=-100)
        if self.loss == "none":
            return F.cross_entropy(logits.view(-1, v), shifted, ignore_index=-100, reduction="none")
        if self.loss == "returned":
            return F.cross_entropy(logits.view(-1, v), shifted, ignore_index=-100), head
        return F.cross_entropy(logits.view(-1, v), shifted, ignore_index=-100)


def _inputs(vocab: int = VOCAB, batch: int = BATCH):
    ids = torch.randint(0, vocab, (batch, SEQ))
    labels = ids.clone()
    labels[:, ::7] = -100
    return ids, labels


CASES = {  # name: (loss spelling, dtype, other backend options)
    "mean": ("mean", torch.float64, {}),
    "slice": ("slice", torch.float64, {}),
    "smoothing": ("smoothing", torch.float64, {}),
    "sum": ("sum", torch.float64, {}),
    "weight": ("weight", torch.float64, {}),
    "none": ("none", torch.float64, {}),
    "returned": ("returned", torch.float64, {}),
    "bf16": ("mean", torch.bfloat16, {}),
    "bf16_sum": ("bf16_sum", torch.bfloat16, {}),
    "aot_eager": ("smoothing", torch.float64, {"inner": "aot_eager"}),
    "autocast": ("mean", torch.float32, {"autocast": torch.bfloat16}),
}
WORLDS = (2, pytest.param(4, marks=pytest.mark.slow))


def _run():
    results = {}
    for name, (loss, dtype, options) in CASES.items():
        torch._dynamo.reset()
        with comm_counter() as sent:
            r = compare_with_one_process(functools.partial(TinyLM, loss), _inputs, dtype=dtype, outputs="gathered",
                                         chunk_loss=CHUNK, **options)
        results[name] = {
            "error": r.max_error(), "summary": r.summary(), "fallbacks": r.fallbacks,
            "chunking": [g.passes["chunking"].counts for g in r.compiled_reports],
            "placements": {k: v for g in r.compiled_reports for k, v in g.placements.items()},
            "booked": sum(c.bytes_by_rank[dist.get_rank()] for g in r.compiled_reports for c in g.comms),
            "measured": sent.payload_bytes_sent}
    results["memory"] = {chunk: _largest_op_allocation(chunk) for chunk in (CHUNK, None)}
    return results


def _largest_op_allocation(chunk_loss):
    """(largest bytes one ATen op allocated in a compiled forward + backward, this rank's rows of logits)."""
    torch._dynamo.reset()
    vocab = 4096
    torch.manual_seed(0)
    model = TinyLM("mean", vocab).double()
    compiled = torch.compile(model, backend=autoshard.backend(chunk_loss=chunk_loss))
    ids, labels = _inputs(vocab, batch=32)
    compiled(ids, labels).backward()  # compile first; then count
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
        compiled(ids, labels).backward()
    largest = max(e.cpu_memory_usage for e in prof.function_events if e.name.startswith("aten::"))
    rows = ids.size(0) * (SEQ // dist.get_world_size())  # the fewest any rank holds
    return largest, rows * vocab * 8


@functools.cache
def _results(world: int):
    return run_on_ranks(_run, world, timeout=600)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(CASES))
def test_chunked_loss_matches_one_process(name, world):
    low = CASES[name][1] == torch.bfloat16 or "autocast" in CASES[name][2]
    tolerance = BF16_TOL if low else 1e-9
    for rank, results in enumerate(_results(world)):
        r = results[name]
        where = f"{name} P={world} rank {rank}"
        assert r["error"] <= tolerance, f"{where}: {r['summary']}"
        assert r["fallbacks"] == [], f"{where}: {r['fallbacks']}"
        kept = int(name == "returned")
        assert r["chunking"] == [{"chunked_losses": 1, "unchunked_losses": 0, "logits_kept": kept}], \
            f"{where}: {r['chunking']}"
        names = set(r["placements"])
        assert any(n.startswith("linear_cross_entropy") for n in names), f"{where}: {sorted(names)}"
        assert not any(n.startswith("cross_entropy") for n in names), f"{where}: the loss is still in the graph"
        heads = [n for n in names if n.startswith(("logits", "l__self___lm_head", "lm_head"))]
        assert len(heads) == kept, f"{where}: the head's output {heads}, expected {kept}"
        assert r["booked"] == r["measured"], f"{where}: bytes booked {r['booked']}, sent {r['measured']}"


@pytest.mark.parametrize("world", WORLDS)
def test_chunked_loss_never_allocates_the_logits(world):
    for rank, results in enumerate(_results(world)):
        (chunked, logits), (whole, _) = results["memory"][CHUNK], results["memory"][None]
        assert chunked < logits / 3, \
            f"P={world} rank {rank}: an op allocated {chunked} B with chunks, logits {logits} B"
        assert whole >= logits, f"P={world} rank {rank}: without chunks the largest op allocated {whole} B"


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("weighted", [False, True])
def test_op_matches_cross_entropy(reduction, smoothing, weighted):
    """The op alone, float64, 3 chunks, bias, ignored targets: loss and gradients of h, W, b equal
    ``cross_entropy(linear(h, W, b))``."""
    torch.manual_seed(0)
    h = torch.randn(2, 19, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(11, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 11, (38,))
    t[::5] = -100
    cw = torch.rand(11, dtype=torch.float64) + 0.5 if weighted else None
    ref = F.cross_entropy(F.linear(h, w, b).view(-1, 11), t, weight=cw, label_smoothing=smoothing, reduction=reduction)
    out = linear_cross_entropy(h, w, t, b, class_weight=cw, label_smoothing=smoothing, reduction=reduction, chunks=3)
    g = torch.randn_like(ref)
    want = torch.autograd.grad((ref * g).sum(), (h, w, b))
    got = torch.autograd.grad((out * g).sum(), (h, w, b))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-12)


def test_chunk_loss_option_is_checked():
    with pytest.raises(ValueError, match="chunk_loss"):
        autoshard.backend(chunk_loss=0)
