"""Masks across graph cuts (issue 21): the recipe long-context users run keeps every attention distributed.

FSDP2 on every decoder layer and the root cuts a model into one graph per layer; transformers builds the mask once,
before the layers, in a graph of its own. That graph hands the mask on uncomputed (a ``DeferredTensor``: the nodes
that build it and the ``O(S)`` inputs they read) and every layer graph reads its structure, as a whole-model
compile does. Each case runs one step on every rank and the same step on one process, and asserts:

* loss and every parameter gradient equal one process's (float64 models; :data:`TOLERANCE`; FlexAttention on
  CPU: forward only -- torch refuses its backward on CPU, inside the traced code, before any backend sees the
  graph -- and its block mask is torch's own, built densely by ``create_block_mask`` on CPU, fused by inductor on
  GPUs; autoshard reads ``mask_mod`` instead);
* every attention of every graph distributed (no ``gathered-kv`` / ``whole``), no fallback;
* no tensor with two dims of the sequence length made on any rank (:func:`~autoshard.testing.memory.sequence_squares`
  over the whole step, user code between the graphs included; the length is larger than every model dim).

Cases: FSDP2 with transformers' own checkpointing (``gradient_checkpointing_enable()``, no dynamo flag: the model is
compiled with ``autoshard.compile``) and packed documents; FSDP2 with left padding; Mistral's sliding window and
Gemma2 (sliding and global layers in turn, soft-capped scores) under FSDP2; a torchtitan-style model compiled block
by block, its document mask built by a function compiled apart; transformers Llama with
``attn_implementation="flex_attention"`` and packed documents under FSDP2; a hand-written ``flex_attention`` with a
document ``mask_mod`` and an ALiBi ``score_mod``. Bad input: a mask the compiler cannot read still crosses the cut,
runs on gathered keys with this rank's rows of it, exact, warned once with the user's line, and the plan says so.
The plan of the FSDP2 recipe on the meta device (``per_layer_graphs``) has the run's attention and bytes. Lengths the
world size does not divide; one launch per world size, one pytest item per case.

A mask built eagerly (transformers' model compiled layer by layer, the rest of it eager: the layers take the mask
dense) is read back into its structure at run time, checked once per mask object, and every attention distributed
(packed documents, a float mask, a sliding window over left padding); one that is no structure (a custom mask, one
entry off) runs on gathered keys, warned. One launch at P=2 of its own (these cases make the dense mask eagerly,
so the ``S x S`` check does not apply).
"""

import copy
import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard
from autoshard.planner.result import MASK_TERMS
from autoshard.runtime import comm_counter
from autoshard.testing import run_on_ranks
from autoshard.testing.memory import sequence_squares

transformers = pytest.importorskip("transformers")

SEQ = 301
"""Neither 2 nor 4 divides it; larger than every other dim (hidden 64, MLP 128, vocabulary 256), so a tensor with
two dims of at least it holds the sequence twice."""
TOLERANCE = {"hf": 1e-6, "handwritten": 1e-9}
"""Relative, float64 models: transformers computes its loss from ``logits.float()`` whatever the model's dtype, so
its loss and every gradient pass through float32 (measured 1e-7); the hand-written models stay float64."""
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=256)
NOT_DISTRIBUTED = ("gathered-kv", "whole")


def _packed_positions(rows: int) -> torch.Tensor:
    """Three documents per row, positions restarting at each (the first shorter than a rank's share at P=4)."""
    cuts = [0, 19, 170, SEQ]
    return torch.cat([torch.arange(b - a) for a, b in zip(cuts, cuts[1:])]).repeat(rows, 1)


def _hf_model(kind: str):
    T = transformers
    if kind == "mistral":
        cfg, cls = T.MistralConfig(num_key_value_heads=2, sliding_window=SEQ // 3, **SMALL), T.MistralForCausalLM
    elif kind == "gemma2":
        cfg = T.Gemma2Config(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=SEQ // 3,
                             attn_logit_softcapping=1.0, final_logit_softcapping=30.0, initializer_range=0.2, **SMALL)
        cls = T.Gemma2ForCausalLM
    else:
        cfg, cls = T.LlamaConfig(num_key_value_heads=2, max_position_embeddings=256, **SMALL), T.LlamaForCausalLM
    cfg._attn_implementation = "eager" if kind == "gemma2" else "sdpa"
    torch.manual_seed(0)
    return cls(cfg).double().train()


def _inputs(kind: str) -> dict:
    gen = torch.Generator().manual_seed(1)
    rows = 1 if "packed" in kind else 2
    ids = torch.randint(0, 256, (rows, SEQ), generator=gen)
    kwargs = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    if "packed" in kind:
        kwargs["position_ids"] = _packed_positions(rows)
    if "padding" in kind:
        mask = torch.ones(rows, SEQ, dtype=torch.long)
        mask[0, :7] = 0
        kwargs["attention_mask"] = mask
    return kwargs


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _summary(compiled_by, squares: list, loss_error: float, grad_error: float) -> dict:
    records = list(getattr(compiled_by, "autoshard_backend", compiled_by).compiled)
    return {"loss": loss_error, "grads": grad_error,
            "strategies": [a["strategy"] for r in records for a in r.report.attention],
            "fallbacks": [f"{f.node}: {f.reason}" for r in records for f in r.report.fallbacks],
            "squares": squares[:3], "flag": torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint}


def _fsdp(kind: str) -> dict:
    """One step of transformers' model under FSDP2 over every rank, compiled with ``autoshard.compile``; with
    ``plan`` in ``kind``, also the plan of the same model built on the meta device (``per_layer_graphs``: the graphs
    FSDP2 cuts it into) beside what the run did and sent."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = False  # as a user's process has it
    model = _hf_model(kind.split("_")[0])
    if "checkpointed" in kind:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = copy.deepcopy(model)
    kwargs = _inputs(kind)
    planned = None
    if "plan" in kind:
        with torch.device("meta"):
            meta = _hf_model(kind.split("_")[0])
        meta.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        plan = autoshard.plan(meta, kwargs=kwargs, world_size=dist.get_world_size(), dp_shard=dist.get_world_size(),
                              rank=dist.get_rank(), per_layer_graphs=True, grad_sync=False)
        region_bytes = sum(c.bytes_per_rank for c in plan.collectives if c.region)  # recomputed regions' collectives
        planned = ([(str(a.strategy), str(a.mask)) for a in plan.attention], int(plan.bytes_sent()),
                   region_bytes == sum(plan.recomputed.values()) > 0)
    ref_loss = reference(**kwargs).loss
    ref_loss.backward()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("sp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = autoshard.compile(model, mesh, grad_sync=False)
    with sequence_squares(SEQ) as squares, comm_counter() as sent:
        loss = compiled(**kwargs).loss
        loss.backward()
    ref = dict(reference.named_parameters())
    grads = max(_relative(p.grad.full_tensor(), ref[n].grad) for n, p in model.named_parameters())
    out = _summary(compiled, squares, _relative(loss.detach(), ref_loss.detach()), grads)
    if planned is not None:
        out["planned"] = planned
        out["ran"] = ([(a["strategy"], ", ".join(k for k in MASK_TERMS if a.get(k)))
                       for r in compiled.autoshard_backend.compiled for a in r.report.attention],
                      int(sent.payload_bytes_sent))
    return out


class _Block(torch.nn.Module):
    """Pre-norm attention + MLP, the mask an argument (as torchtitan's blocks take theirs)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(64), torch.nn.RMSNorm(64)
        self.qkv, self.out = torch.nn.Linear(64, 192, bias=False), torch.nn.Linear(64, 64, bias=False)
        self.up, self.down = torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(128, 64, bias=False)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, 64))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _document_mask(position_ids):
    """Causal inside each document: a document starts where positions restart."""
    starts = torch.cat([torch.ones_like(position_ids[:, :1]), (position_ids[:, 1:] == 0).long()], 1)
    documents = starts.cumsum(-1)
    index = torch.arange(position_ids.size(-1), device=position_ids.device)
    same = documents[:, :, None] == documents[:, None, :]
    return (same & (index[None, :, None] >= index[None, None, :]))[:, None]


class _PerBlockLM(torch.nn.Module):
    """torchtitan's recipe: every block compiled apart, the model's own code between them eager; the mask built by
    a function compiled apart too."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(256, 64)
        self.blocks = torch.nn.ModuleList([_Block() for _ in range(2)])
        self.head = torch.nn.Linear(64, 256, bias=False)

    def forward(self, ids, position_ids, labels):
        mask = self.build_mask(position_ids)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, mask)
        return self.loss(x, labels)

    def build_mask(self, position_ids):
        return _document_mask(position_ids)

    def loss(self, x, labels):
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


def _per_block() -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _PerBlockLM().double()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(2))
    args = (ids, _packed_positions(2), ids)
    ref_loss = reference(*args)
    ref_loss.backward()
    be = autoshard.backend()
    for block in model.blocks:
        block.compile(backend=be)
    model.build_mask = torch.compile(model.build_mask, backend=be)
    model.loss = torch.compile(model.loss, backend=be)
    with sequence_squares(SEQ) as squares:
        loss = model(*args)
        loss.backward()
    ref = dict(reference.named_parameters())
    grads = max(_relative(p.grad, ref[n].grad) for n, p in model.named_parameters())
    return _summary(be, squares, _relative(loss.detach(), ref_loss.detach()), grads)


def _flex_llama() -> dict:
    """transformers' FlexAttention path, packed documents, FSDP2; the one-process reference is the same weights
    through SDPA (FlexAttention has no CPU backward, nor an eager CPU path in transformers)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    reference = _hf_model("llama").eval()
    model = copy.deepcopy(reference)
    model.config._attn_implementation = "flex_attention"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("sp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    compiled = autoshard.compile(model, mesh, grad_sync=False)
    kwargs = _inputs("packed")
    with torch.no_grad():
        want = reference(**kwargs).logits
        got = compiled(**kwargs).logits.full_tensor()
    return _summary(compiled, [], _relative(got, want), 0.0)


class _FlexAlibi(torch.nn.Module):
    """A hand-written attention through ``flex_attention``: documents in ``mask_mod``, ALiBi in ``score_mod``."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)
        self.register_buffer("slopes", 2.0 ** -torch.arange(1, 5, dtype=torch.float64))
        self.dense = False

    def forward(self, x, documents):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        slopes = self.slopes
        if self.dense:  # the one-process reference: the same mask and bias, written out
            i = torch.arange(s)
            keep = (i[None, :] <= i[:, None]) & (documents[:, :, None] == documents[:, None, :])
            bias = slopes[:, None, None] * (i[None, :] - i[:, None]).double()
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(~keep[:, None], float("-inf")))
        else:
            def mask_mod(batch, head, q_idx, kv_idx):
                return (kv_idx <= q_idx) & (documents[batch, q_idx] == documents[batch, kv_idx])

            def score_mod(score, batch, head, q_idx, kv_idx):
                return score + slopes[head] * (kv_idx - q_idx)

            block_mask = create_block_mask(mask_mod, b, None, s, s, device=x.device)
            out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
        return self.out(out.transpose(1, 2).reshape(b, s, 64))


def _flex_handwritten() -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _FlexAlibi().double()
    reference = copy.deepcopy(model)
    reference.dense = True
    x = torch.randn(2, SEQ, 64, dtype=torch.float64)
    documents = torch.tensor([[0] * 19 + [1] * 151 + [2] * 131, [0] * 180 + [1] * 121])
    be = autoshard.backend(outputs="gathered")
    with torch.no_grad():
        got = torch.compile(model, backend=be)(x, documents)
        want = reference(x, documents)
    return _summary(be, [], _relative(got, want), 0.0)


class _Unreadable(torch.nn.Module):
    """A mask the compiler cannot read (every third key, by index parity of q + k), built before a graph break."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = torch.nn.Linear(64, 192), torch.nn.Linear(64, 64)

    def forward(self, x):
        b, s, _ = x.shape
        i = torch.arange(s)
        mask = ((i[:, None] + i[None, :]) % 3 != 0) | (i[:, None] == i[None, :])
        torch._dynamo.graph_break()
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, s, 64))


def _unreadable() -> dict:
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Unreadable().double()
    reference = copy.deepcopy(model)
    x = torch.randn(2, SEQ, 64, dtype=torch.float64)
    be = autoshard.backend(outputs="gathered")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(model, backend=be)(x)
        got = torch.compile(model, backend=be)(x)  # a second call: no second warning
    plan = autoshard.plan(copy.deepcopy(reference), x, world_size=dist.get_world_size())
    return {"error": _relative(got, reference(x)), "strategies": [a["strategy"] for r in be.compiled
                                                                  for a in r.report.attention],
            "warnings": [str(w.message) for w in caught if "is not distributed" in str(w.message)],
            "plan": [(a.strategy, a.mask) for a in plan.attention]}


def _eager_mask_model(kind: str) -> dict:
    """transformers' model compiled layer by layer (``layer.compile``), the rest of it eager: the mask transformers
    builds before the layers reaches every layer graph dense, and is read back into its structure at run time
    (``packed``: documents; ``float``: documents in eager attention's float mask; ``mistral``: a sliding window
    over left padding); ``perturbed``: a 4-D mask passed in, the packed documents' with one entry more, which no
    structure makes (gathered, warned, exact)."""
    from autoshard.runtime import dense_masks

    torch._dynamo.reset()
    model = _hf_model("mistral" if kind == "mistral" else "llama")
    if kind == "float":
        model.config._attn_implementation = "eager"
    reference = copy.deepcopy(model)
    kwargs = _inputs("padding" if kind == "mistral" else "packed")
    if kind == "perturbed":
        mask = _document_mask(kwargs["position_ids"])
        mask[:, :, 200, 30] = True  # a key of another document
        kwargs["attention_mask"] = mask
    ref_loss = reference(**kwargs).loss
    ref_loss.backward()
    backend = autoshard.backend()
    for layer in model.model.layers:
        layer.compile(backend=backend)
    reads, read = [], dense_masks._read
    dense_masks._read = lambda mask, pg: reads.append(mask.shape) or read(mask, pg)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = model(**kwargs).loss
            loss.backward()
    finally:
        dense_masks._read = read
    ref = dict(reference.named_parameters())
    grads = max(_relative(p.grad, ref[n].grad) for n, p in model.named_parameters())
    out = _summary(backend, [], _relative(loss.detach(), ref_loss.detach()), grads)
    out["reads"] = len(reads)
    out["warnings"] = [str(w.message) for w in caught if "is not distributed" in str(w.message)]
    return out


EAGER_MASKS = ("packed", "float", "mistral", "perturbed")


def _eager_masks() -> dict:
    return {kind: _eager_mask_model(kind) for kind in EAGER_MASKS}


@functools.cache
def _eager_mask_results() -> list[dict]:
    return run_on_ranks(_eager_masks, 2, timeout=900)


@pytest.mark.parametrize("kind", EAGER_MASKS[:3])
def test_per_block_compile_reads_an_eager_mask_as_structure(kind):
    """The dense mask built outside the compiled layers is checked (each rank its rows, once for both layers) and
    taken as its structure: every attention distributed, no fallback, loss and gradients as one process's."""
    for rank, r in enumerate(_eager_mask_results()):
        r = r[kind]
        assert r["loss"] < TOLERANCE["hf"] and r["grads"] < TOLERANCE["hf"], (rank, r)
        assert r["strategies"] and not set(r["strategies"]) & set(NOT_DISTRIBUTED), (rank, r)
        assert r["fallbacks"] == [] and r["warnings"] == [], (rank, r)
        assert r["reads"] == 1, (rank, r)


def test_per_block_compile_keeps_an_eager_mask_no_structure_makes_dense():
    """A mask that is not the structure its values suggest runs on gathered keys with this rank's rows of it,
    exact, warned with the reason; the entry off is in rank 1's rows only, and both ranks take the gathered path."""
    for rank, r in enumerate(_eager_mask_results()):
        r = r["perturbed"]
        assert r["loss"] < TOLERANCE["hf"] and r["grads"] < TOLERANCE["hf"], (rank, r)
        assert set(r["strategies"]) == {"gathered-kv"}, (rank, r)
        assert len(r["warnings"]) == 1 and "checked on every call" in r["warnings"][0], (rank, r)


SLOW = ("fsdp_mistral", "fsdp_gemma2", "flex_handwritten", "fsdp_padding", "per_block")
"""2-rank cases marked slow and run in a launch of their own: the FSDP2 recipe with Mistral's window and Gemma2's
soft cap (``test_hf_models.py`` runs both models' masks; the recipe runs here with padding and packed documents), and
FlexAttention in a hand-written model (transformers' FlexAttention runs in the default tier), the recipe with left
padding instead of packed documents, and per-block compilation (test_graph_boundaries.py and the eager-mask tests below
run it by default)."""


def _run(world: int, slow: bool) -> dict:
    jobs = {"fsdp_checkpointed_packed": functools.partial(_fsdp, "llama_checkpointed_packed_plan"),
            "per_block": _per_block}
    if world == 2:
        jobs.update({name: functools.partial(_fsdp, kind) for name, kind in (
            ("fsdp_padding", "llama_padding"), ("fsdp_mistral", "mistral"), ("fsdp_gemma2", "gemma2"))})
        jobs.update({"flex_llama": _flex_llama, "flex_handwritten": _flex_handwritten, "unreadable": _unreadable})
    return {name: job() for name, job in jobs.items() if (name in SLOW) == slow}


def _results(world: int, slow: bool = False) -> list[dict]:
    return _launch(world, slow)


@functools.cache
def _launch(world: int, slow: bool) -> list[dict]:
    """One launch per (world, slow): cached under one key however the tests pass ``slow`` (a second launch in the
    same rank processes would find the warn-once attention warnings already given)."""
    return run_on_ranks(_run, world, world, slow, timeout=900)


CASES = [(2, "fsdp_checkpointed_packed"), *(pytest.param(2, name, marks=pytest.mark.slow) for name in SLOW),
         (2, "flex_llama"),
         pytest.param(4, "fsdp_checkpointed_packed", marks=pytest.mark.slow),
         pytest.param(4, "per_block", marks=pytest.mark.slow)]


@pytest.mark.parametrize("world,case", CASES)
def test_every_attention_distributed_and_exact(world, case):
    tolerance = TOLERANCE["handwritten" if case in ("per_block", "flex_handwritten") else "hf"]
    for rank, result in enumerate(_results(world, case in SLOW)):
        r = result[case]
        assert r["loss"] < tolerance and r["grads"] < tolerance, (rank, r)
        assert r["strategies"] and not set(r["strategies"]) & set(NOT_DISTRIBUTED), (rank, r)
        assert r["fallbacks"] == [], (rank, r)
        assert r["squares"] == [], (rank, r)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_backend_sets_the_checkpoint_flag_before_dynamo_traces(world):
    """The checkpointed case started with dynamo's checkpoint flag unset, as a user's process has it: the backend
    set it when it was made (:func:`autoshard.config.trace_checkpointed_layers`), and the layers compiled."""
    for result in _results(world):
        assert result["fsdp_checkpointed_packed"]["flag"] is True


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_meta_plan_of_the_fsdp2_recipe_is_the_run(world):
    """The plan of the FSDP2 recipe, built on the meta device, has the run's attention (strategy and mask of every
    layer graph) and the bytes the run sent, exactly (the documents' keys fetched and queries dispatched for the
    batch's ``position_ids`` included, in the checkpointed layers' recomputation too)."""
    for result in _results(world):
        r = result["fsdp_checkpointed_packed"]
        (planned, planned_bytes, region_bytes_agree), (run_attention, run_bytes) = r["planned"], r["ran"]
        assert set(planned) == set(run_attention) == {("allgather", "causal, segment_ids")} and len(planned) == 2, r
        assert planned_bytes == run_bytes and region_bytes_agree, r


def test_unreadable_mask_is_gathered_warned_once_and_planned():
    for result in _results(2):
        r = result["unreadable"]
        assert r["error"] < TOLERANCE["handwritten"], r
        assert r["strategies"] == ["gathered-kv"], r
        assert len(r["warnings"]) == 1 and "test_mask_boundaries.py" in r["warnings"][0], r
        assert r["plan"] == [("gathered-kv", "dense")], r
