"""Unmodified diffusers transformers (image and video DiTs) under the one-liner: outputs and every parameter
gradient equal the uncompiled one-process run (float64), every attention distributed, 0 fallbacks.

Tiny configs with random weights, token counts neither world size divides (attention lengths 15 to 69). What each
model exercises:

* Flux, QwenImage, SD3, HunyuanVideo: a joint ``[text; image]`` sequence, concatenated and split back
  (``split_with_sizes`` or slices along the sequence): each part keeps the positions of the joint layout it
  holds, no gather. HunyuanVideo's text padding over the joint sequence is a key mask.
* Wan, CogVideoX, LTX, PixArt, Sana: patchify (``conv3d``/``conv2d`` then ``flatten``) starts the token
  sequence; Wan's rotary embedding writes ``out[..., 0::2] = ...`` into ``empty_like`` and CogVideoX its
  positions through ``joint.data[:, text:].copy_(...)`` (both functionalized); cross-attention to the text,
  which stays whole on every rank, runs on each rank's queries with no traffic. SD3 patchifies its image tokens
  before they join the text. Sana's Mix-FFN convolves the tokens as an image (``unflatten(1, (H, W))``, a 3 x 3
  depth-wise ``conv2d``): each rank convolves its own tokens with the rows around them from its neighbours.

A pipeline as a user runs it: ``WanPipeline`` (a tiny VAE and transformer, prompt embeddings given, classifier-free
guidance, 30 denoising steps, float64) with ``pipe.transformer = torch.compile(pipe.transformer, backend=...)``
returns one process's latents, with one compilation for every step (the timestep is a value, not a shape). The
transformer at five latent shapes (frames, height and width changing): two compilations, the second a length class
of symbolic frames, height and width. A ``SanaPipeline`` at 3 ranks (slow tier): its Mix-FFN convolves tokens a
rank holds part rows of, one compilation, one process's latents.

Training (slow tier): three AdamW steps of a flow-matching loss (``mse(model(x_t, t), noise - x0)``) on Flux,
Wan and Sana, FSDP2 over both ranks (every block and the root) with autoshard's recomputed layers, equal one-process
training (float64). diffusers' own ``enable_gradient_checkpointing()`` under FSDP2 is not the recipe: dynamo runs
the checkpointed FSDP blocks eagerly there, so they run whole on every rank (exact, not distributed).

Tolerances: 1e-12 relative, except Wan and Sana (1e-6): they compute some norms in float32 by design
(``FP32LayerNorm``), whose gradients, summed over the ranks in another order, differ in float32's last bits.
HunyuanVideo's token refiner (self-attention over the text) masks ``m[q] & m[k]`` with key 0 always visible: a key
mask with key 0 joined, and its padding rows take key 0's value (the one value gathered, ``[B, H, 1, D]``).
"""

import functools

import pytest
import torch

import autoshard

diffusers = pytest.importorskip("diffusers")

from autoshard.testing import run_on_ranks  # noqa: E402
from autoshard.testing.equivalence import compare_with_one_process  # noqa: E402


WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, text_dim=16, freq_dim=16, ffn_dim=32,
           num_layers=1, rope_max_seq_len=32)


def build(name: str):
    """(model factory, forward kwargs) of a tiny diffusers transformer with random weights."""
    D = diffusers
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    if name == "flux":  # 14 image tokens + 5 text tokens
        cfg = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8, axes_dims_rope=(4, 6, 6))
        s, t = 14, 5
        img_ids = torch.stack([torch.zeros(s), torch.arange(s) // 5, torch.arange(s) % 5], -1)
        kw = dict(hidden_states=r(1, s, 4), encoder_hidden_states=r(1, t, 8), pooled_projections=r(1, 8),
                  timestep=torch.tensor([0.5], dtype=torch.float64), img_ids=img_ids, txt_ids=torch.zeros(t, 3))
        return (lambda: D.FluxTransformer2DModel(**cfg)), kw
    if name == "qwenimage":
        cfg = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=16,
                   num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(4, 6, 6))
        mask = torch.ones(1, 6, dtype=torch.long)
        kw = dict(hidden_states=r(1, 15, 16), encoder_hidden_states=r(1, 6, 16), encoder_hidden_states_mask=mask,
                  timestep=torch.tensor([0.5], dtype=torch.float64), img_shapes=[(1, 3, 5)])
        return (lambda: D.QwenImageTransformer2DModel(**cfg)), kw
    if name == "sd3":
        cfg = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8,
                   num_attention_heads=2, joint_attention_dim=8, caption_projection_dim=16, pooled_projection_dim=8,
                   out_channels=4, pos_embed_max_size=16)
        kw = dict(hidden_states=r(1, 4, 6, 10), encoder_hidden_states=r(1, 6, 8), pooled_projections=r(1, 8),
                  timestep=torch.tensor([3]))
        return (lambda: D.SD3Transformer2DModel(**cfg)), kw
    if name == "hunyuanvideo":  # the last two text tokens are padding; 3 x 3 x 7 patches
        cfg = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
                   num_single_layers=1, num_refiner_layers=1, mlp_ratio=2, patch_size=1, patch_size_t=1,
                   text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
        mask = torch.tensor([[1, 1, 1, 1, 0, 0]])
        kw = dict(hidden_states=r(1, 4, 3, 3, 7), timestep=torch.tensor([3]), encoder_hidden_states=r(1, 6, 16),
                  encoder_attention_mask=mask, pooled_projections=r(1, 8),
                  guidance=torch.tensor([3.0], dtype=torch.float64))
        return (lambda: D.HunyuanVideoTransformer3DModel(**cfg)), kw
    if name == "wan":  # 3 x 3 x 5 patches
        kw = dict(hidden_states=r(1, 4, 3, 6, 10), timestep=torch.tensor([3]), encoder_hidden_states=r(1, 5, 16))
        return (lambda: D.WanTransformer3DModel(**WAN, in_channels=4, out_channels=4)), kw
    if name == "cogvideox":  # 6 text tokens + 3 x 3 x 5 patches
        cfg = dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
                   text_embed_dim=8, num_layers=1, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
                   temporal_compression_ratio=4, max_text_seq_length=6)
        kw = dict(hidden_states=r(1, 3, 4, 6, 10), encoder_hidden_states=r(1, 6, 8), timestep=torch.tensor([3]))
        return (lambda: D.CogVideoXTransformer3DModel(**cfg)), kw
    if name == "ltx":  # text padding on the cross-attention's keys
        cfg = dict(in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
                   attention_head_dim=8, cross_attention_dim=16, num_layers=1, caption_channels=16)
        mask = torch.tensor([[1, 1, 1, 0, 0]])
        kw = dict(hidden_states=r(1, 45, 8), encoder_hidden_states=r(1, 5, 16), timestep=torch.tensor([3]),
                  encoder_attention_mask=mask, num_frames=3, height=3, width=5)
        return (lambda: D.LTXVideoTransformer3DModel(**cfg)), kw
    if name == "pixart":
        cfg = dict(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=8, num_attention_heads=2,
                   in_channels=4, cross_attention_dim=16, out_channels=8, caption_channels=16,
                   norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6)
        kw = dict(hidden_states=r(1, 4, 6, 10), encoder_hidden_states=r(1, 5, 16), timestep=torch.tensor([3]),
                  added_cond_kwargs={"resolution": None, "aspect_ratio": None})
        return (lambda: D.PixArtTransformer2DModel(**cfg)), kw
    if name == "sana":  # linear self-attention (sums over the tokens), softmax cross-attention
        cfg = dict(patch_size=1, in_channels=4, out_channels=4, num_layers=1, num_attention_heads=2,
                   attention_head_dim=8, num_cross_attention_heads=2, cross_attention_head_dim=8,
                   cross_attention_dim=16, caption_channels=16, sample_size=8)
        kw = dict(hidden_states=r(1, 4, 7, 9), encoder_hidden_states=r(1, 5, 16), timestep=torch.tensor([3]))
        return (lambda: D.SanaTransformer2DModel(**cfg)), kw
    raise ValueError(name)


TOLERANCE = {"wan": 1e-6, "sana": 1e-6}
TRAINED = {"wan": 1e-6, "sana": 2e-6}
"""The parameters after three AdamW steps: Sana's float32 norms' last bits, through Adam's normalization, reach
1.1e-6."""
GATHERS = {"flux": 0, "ltx": 0, "qwenimage": 4, "hunyuanvideo": 2}
"""All-gathers in a model's graph, per model; the others' one is the output, unpatchified once at the end (the
tokens are never gathered inside the blocks). Flux and LTX return the tokens, split. QwenImage: the rows of its
rotary tables the image positions read (the text's positions are a slice of the same table, so the table's rows
follow the text's split): a few rows each. HunyuanVideo: key 0's value for its refiner's padding rows (see above)
and the output."""


def _run(names):
    out = []
    for name in names:
        torch._dynamo.reset()
        torch.manual_seed(0)
        make, kwargs = build(name)
        r = compare_with_one_process(make, lambda: (), kwargs=dict(kwargs, return_dict=False), dtype=torch.float64)
        gathers = [t for t in r.transitions if t.startswith("all_gather")]
        out.append((name, r.max_error(), r.summary(), r.fallbacks, [a["strategy"] for a in r.attention], gathers))
    return out


def _pipeline():
    """A ``WanPipeline`` with a tiny VAE and transformer (no tokenizer or text encoder: prompt embeddings are given)."""
    D = diffusers
    torch.manual_seed(0)
    transformer = D.WanTransformer3DModel(**WAN, in_channels=16, out_channels=16)  # the VAE's 16 latent channels
    vae = D.AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1)
    pipe = D.WanPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                         scheduler=D.FlowMatchEulerDiscreteScheduler(shift=3.0))
    return pipe.to(torch.float64)


def _sample(pipe) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    text, negative = (torch.randn(1, 5, 16, generator=g, dtype=torch.float64) for _ in range(2))
    return pipe(prompt_embeds=text, negative_prompt_embeds=negative, height=48, width=80, num_frames=9,
                num_inference_steps=30, guidance_scale=5.0, generator=torch.Generator().manual_seed(2),
                output_type="latent", return_dict=False)[0]


def _pipeline_run() -> dict:
    torch._dynamo.reset()
    expected = _sample(_pipeline())
    pipe = _pipeline()
    backend = autoshard.backend(outputs="gathered")
    pipe.transformer = torch.compile(pipe.transformer, backend=backend)
    got = _sample(pipe)
    error = ((got - expected).abs().max() / expected.abs().max()).item()
    strategies = sorted({a["strategy"] for g in backend.compiled for a in g.report.attention})
    return {"error": error, "compilations": sum(backend.compilations.values()), "strategies": strategies,
            "shape": tuple(got.shape)}


def _sana_pipeline(backend=None):
    """A ``SanaPipeline`` with a tiny DC-AE and transformer (prompt embeddings given), 20 steps with guidance, on a
    16 x 32 latent: 512 tokens, so 3 ranks' tokens end inside rows of the Mix-FFN's image. Returns (latents,
    compilations, halo exchanges of the transformer's graphs)."""
    D = diffusers
    torch.manual_seed(0)
    transformer = D.SanaTransformer2DModel(patch_size=1, in_channels=4, out_channels=4, num_layers=2,
                                           num_attention_heads=2, attention_head_dim=8, num_cross_attention_heads=2,
                                           cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16,
                                           sample_size=8)
    vae = D.AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=4, encoder_block_out_channels=(8, 8),
                          decoder_block_out_channels=(8, 8), encoder_layers_per_block=(1, 1),
                          decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), ()),
                          decoder_qkv_multiscales=((), ()), scaling_factor=0.41)
    pipe = D.SanaPipeline(tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
                          scheduler=D.FlowMatchEulerDiscreteScheduler(shift=3.0)).to(torch.float64)
    if backend is not None:
        pipe.transformer = torch.compile(pipe.transformer, backend=backend)
    g = torch.Generator().manual_seed(1)
    text, negative = (torch.randn(1, 5, 16, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(1, 5, dtype=torch.long)
    latents = pipe(prompt_embeds=text, prompt_attention_mask=mask, negative_prompt=None,
                   negative_prompt_embeds=negative, negative_prompt_attention_mask=mask, height=32, width=64,
                   num_inference_steps=20, guidance_scale=4.5, generator=torch.Generator().manual_seed(2),
                   output_type="latent", return_dict=False, use_resolution_binning=False)[0]
    compiled = backend.compiled if backend is not None else []
    return latents, sum(backend.compilations.values()) if backend is not None else 0, sum(
        c.kind == "halo_exchange" for graph in compiled for c in graph.report.comms)


def _sana_pipeline_run() -> tuple:
    torch._dynamo.reset()
    expected, _, _ = _sana_pipeline()
    got, compilations, halos = _sana_pipeline(autoshard.backend(outputs="gathered"))
    return ((got - expected).abs().max() / expected.abs().max()).item(), compilations, halos


@pytest.mark.slow
def test_a_sana_pipeline_samples_as_one_process_with_its_mix_ffn_split():
    """SanaPipeline at 3 ranks, as a user runs it: one process's latents (Sana's float32 norms: 1e-6), one
    compilation for the 40 transformer calls, the Mix-FFN's 3 x 3 convolution exchanging halos in every layer."""
    for rank, (error, compilations, halos) in enumerate(run_on_ranks(_sana_pipeline_run, 3, timeout=900)):
        where = f"SanaPipeline P=3 rank {rank}: error {error:.1e}, {compilations} compilations, {halos} halos"
        assert error <= 1e-6 and compilations == 1 and halos == 2, where


DEFAULT = ["flux", "wan"]
"""The default suite: a joint sequence split back (Flux), patchify with strided rotary writes and cross-attention
(Wan); the other models (CogVideoX's write through ``.data`` is functionalize's unit test too) and 4 ranks in the
slow tier."""
SLOW = ["cogvideox", "qwenimage", "sd3", "hunyuanvideo", "ltx", "pixart", "sana"]
CASES = [(2, n) for n in DEFAULT + SLOW] + [(4, n) for n in DEFAULT + SLOW]


SHAPES = ((3, 6, 10), (5, 8, 12), (4, 10, 8), (3, 6, 10), (6, 12, 12))
"""Latent video shapes (frames, height, width) a Wan transformer is called with in turn: 45 to 216 tokens."""


def _new_shapes() -> dict:
    """The Wan transformer (float64, no gradients) at every shape of ``SHAPES``, against the uncompiled model: the
    largest difference, the compilations, and the attention strategies and fallbacks of every graph compiled."""
    torch._dynamo.reset()  # dynamo's state of the same code from the models compiled before in this process
    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**WAN, in_channels=4, out_channels=4).double().eval()
    backend = autoshard.backend()
    compiled = torch.compile(model, backend=backend)
    generator = torch.Generator().manual_seed(0)
    worst = 0.0
    for frames, height, width in SHAPES:
        kw = dict(hidden_states=torch.randn(1, 4, frames, height, width, generator=generator, dtype=torch.float64),
                  timestep=torch.tensor([3]),
                  encoder_hidden_states=torch.randn(1, 5, 16, generator=generator, dtype=torch.float64))
        with torch.no_grad():
            worst = max(worst, (compiled(**kw).sample - model(**kw).sample).abs().max().item())
    return {"error": worst, "compilations": len(backend.compiled),
            "strategies": [sorted(a["strategy"] for a in r.report.attention) for r in backend.compiled],
            "fallbacks": sum(len(r.report.fallbacks) for r in backend.compiled)}


def _launch(names, pipeline: bool) -> tuple:
    return _run(names), (_pipeline_run(), _new_shapes()) if pipeline else None


@functools.cache
def _results(world: int, slow: bool) -> dict:
    """Every rank's (results by model, pipeline run): one launch per world size and tier, the pipeline with the
    default tier."""
    names = [n for n in DEFAULT + SLOW if ((n in SLOW or world == 4) == slow)]
    launched = run_on_ranks(_launch, world, names, world == 2 and not slow, timeout=900)
    return {rank: ({r[0]: r for r in results}, pipeline) for rank, (results, pipeline) in enumerate(launched)}


@pytest.mark.parametrize("world,name", [pytest.param(w, n, marks=[pytest.mark.slow] if n in SLOW or w == 4 else [])
                                        for w, n in CASES], ids=[f"P{w}-{n}" for w, n in CASES])
def test_diffusers_transformer_matches_one_process(world, name):
    for rank, (results, _) in _results(world, name in SLOW or world == 4).items():
        _, err, summary, fallbacks, strategies, gathers = results[name]
        where = f"{name} P={world} rank {rank}"
        assert err <= TOLERANCE.get(name, 1e-12), f"{where}: {summary}"
        assert fallbacks == [], f"{where}: {fallbacks}"
        assert strategies and not {"whole", "gathered-kv"} & set(strategies), f"{where}: {strategies}"
        assert len(gathers) == GATHERS.get(name, 1), f"{where}: {gathers}"


def test_a_wan_pipeline_samples_as_one_process_with_one_compilation():
    for rank, (_, (pipeline, _)) in _results(2, False).items():
        where = f"WanPipeline P=2 rank {rank}: {pipeline}"
        assert pipeline["shape"] == (1, 16, 3, 6, 10) and pipeline["error"] <= 1e-12, where
        assert pipeline["compilations"] == 1, where  # 30 steps x (text, negative): the timestep is a value
        assert pipeline["strategies"] == ["allgather", "local"], where


def test_a_video_transformer_at_new_shapes_compiles_once_more():
    """Wan at five latent video shapes, frames, height and width all changing (one shape again): the first compiles
    dynamo's static graph, the second the length class of symbolic frames, height and width that serves the rest
    (the rotary table's slices and the patchify's flatten stay symbolic); one process's outputs, every graph's
    self-attention distributed and its cross-attention local, no fallback."""
    for rank, (_, (_, shapes)) in _results(2, False).items():
        where = f"Wan at {SHAPES}, P=2 rank {rank}: {shapes}"
        assert shapes["error"] <= 1e-12 and shapes["compilations"] == 2, where
        assert shapes["strategies"] == [["allgather", "local"]] * 2 and shapes["fallbacks"] == 0, where


def _train(name: str) -> tuple:
    """Three AdamW steps of flow matching on ``name``, FSDP2 over the 2 ranks and recomputed layers, against one
    process: (largest relative parameter difference, attention strategies, recomputed layers)."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("sp",))
    torch.manual_seed(0)
    make, kwargs = build(name)
    model = make().double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x0 = kwargs["hidden_states"]
    steps = [(torch.randn(x0.shape, generator=g, dtype=torch.float64), torch.rand(1, generator=g, dtype=torch.float64))
             for _ in range(3)]

    def loss(net, noise, t):
        noisy = (1 - t) * x0 + t * noise
        pred = net(**dict(kwargs, hidden_states=noisy, timestep=t * 1000 if name == "wan" else t), return_dict=False)[0]
        return F.mse_loss(pred, noise - x0)

    def train(net, params):
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        for noise, t in steps:
            loss(net, noise, t).backward()
            optimizer.step()
            optimizer.zero_grad()

    train(reference, reference.parameters())
    for block in [b for attr in ("transformer_blocks", "single_transformer_blocks", "blocks")
                  for b in getattr(model, attr, [])]:
        fully_shard(block, mesh=mesh)
    backend = autoshard.backend(mesh, grad_sync=False, recompute="layers")
    train(torch.compile(fully_shard(model, mesh=mesh), backend=backend), model.parameters())
    ref = dict(reference.named_parameters())
    worst = max(((p.full_tensor() - ref[n]).abs().max() / ref[n].abs().max()).item()
                for n, p in model.named_parameters())
    strategies = sorted({a["strategy"] for graph in backend.compiled for a in graph.report.attention})
    recomputed = sum(graph.report.passes["recompute"].counts.get("recomputed_layers", 0) for graph in backend.compiled)
    halos = sum(c.kind == "halo_exchange" for graph in backend.compiled for c in graph.report.comms)
    return worst, strategies, recomputed, halos


@pytest.mark.slow
def test_flow_matching_training_with_fsdp2_and_recomputed_layers():
    """Flux, Wan and Sana (its Mix-FFN's convolutions fetching the rows around each rank's tokens, forward and
    backward)."""
    for name, strategies in (("flux", ["allgather"]), ("wan", ["allgather", "local"]), ("sana", ["local"])):
        for rank, (worst, run_strategies, recomputed_layers, halos) in enumerate(run_on_ranks(_train, 2, name,
                                                                                                timeout=900)):
            where = (f"{name} P=2 rank {rank}: {run_strategies}, {recomputed_layers} recomputed layers, {halos} halo "
                     f"exchanges")
            assert worst <= TRAINED.get(name, 1e-10), f"{where}: parameters off by {worst:.2e}"
            assert run_strategies == strategies and recomputed_layers > 0 and (halos > 0) == (name == "sana"), where
