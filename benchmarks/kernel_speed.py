"""Attention kernel throughput: autoshard's Triton kernels against torch SDPA's flash backend.

    python benchmarks/kernel_speed.py [--seq 4096,16384,65536] [--head-dim 64,128] [--rep 200]

For every S x D x (causal, not) in bf16 it prints TFLOP/s of the forward and of forward+backward for
both implementations, the ratio ours / SDPA, and the largest difference between the two outputs and
input gradients (relative to the largest SDPA value). FLOPs follow FlashAttention's convention: the
forward is 4 * B * H * S^2 * D (half of it when causal) and forward+backward 3.5 times that, whatever
each implementation recomputes. Shapes keep B * S = 16k tokens and H * D = 2048. Our side is the
differentiable single-block function (``triton_attention``: out and gradients in bf16), autotuned on
its first call for each shape (that call is excluded from the timing). Needs a CUDA GPU: without one
it says so and exits 0. Exits 1 when outputs disagree beyond bf16 tolerance; never asserts on time.
"""

from __future__ import annotations

import argparse
import sys

import torch


def attention_flops(batch, heads, seq, head_dim, causal, backward):
    flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
    return flops * (3.5 if backward else 1.0)


def max_rel_diff(ours, theirs):
    return ((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max().clamp_min(1e-6)).item()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", default="4096,16384,65536", help="comma-separated sequence lengths")
    parser.add_argument("--head-dim", default="64,128", help="comma-separated head dims")
    parser.add_argument("--rep", type=int, default=200, help="milliseconds of timed repetitions per measurement")
    parser.add_argument("--tolerance", type=float, default=5e-2, help="largest relative difference accepted")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_speed.py needs a CUDA GPU (none found): nothing measured.")
        return 0

    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention

    from autoshard.kernels import attention as attn
    from autoshard.kernels import autotune
    from autoshard.kernels.attention_backward import _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel
    from autoshard.kernels.attention_forward import _attn_fwd_kernel

    def sdpa(q, k, v, causal):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(q, k, v, is_causal=causal)

    def ours(q, k, v, causal):
        return attn.triton_attention(q, k, v, causal=causal)

    def time_ms(fn, grads):
        return triton.testing.do_bench(fn, warmup=25, rep=args.rep, grad_to_none=grads)

    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"autotune {'on' if autotune.AUTOTUNE else 'off'}")
    header = (f"{'S':>6} {'D':>4} {'causal':>6} {'B':>3} {'H':>3} | {'fwd ours':>9} {'fwd sdpa':>9} {'ratio':>6} | "
              f"{'f+b ours':>9} {'f+b sdpa':>9} {'ratio':>6} | {'max rel diff':>12} | configs fwd / dq / dkdv")
    print("TFLOP/s (bf16)")
    print(header)
    print("-" * len(header))
    failed = False
    for seq in (int(s) for s in args.seq.split(",")):
        for head_dim in (int(d) for d in args.head_dim.split(",")):
            for causal in (False, True):
                batch, heads = max(1, 16384 // seq), 2048 // head_dim
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, dout = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                                             generator=gen) for _ in range(4))
                q, k, v = (x.requires_grad_() for x in (q, k, v))

                results = {}
                for name, fn in (("ours", ours), ("sdpa", sdpa)):
                    for x in (q, k, v):  # the previous timing loop leaves its last gradients behind
                        x.grad = None
                    out = fn(q, k, v, causal)  # first call: autotuning / compilation, also the values compared
                    out.backward(dout)
                    results[name] = [out.detach()] + [x.grad.detach().clone() for x in (q, k, v)]
                    with torch.no_grad():
                        fwd_ms = time_ms(lambda: fn(q, k, v, causal), None)
                    fwd_bwd_ms = time_ms(lambda: fn(q, k, v, causal).backward(dout), [q, k, v])
                    results[name] += [fwd_ms, fwd_bwd_ms]

                diff = max(max_rel_diff(a, b) for a, b in zip(results["ours"][:4], results["sdpa"][:4]))
                failed |= not diff <= args.tolerance

                def tflops(ms, backward):
                    return attention_flops(batch, heads, seq, head_dim, causal, backward) / (ms * 1e-3) / 1e12

                f_ours, f_sdpa = tflops(results["ours"][4], False), tflops(results["sdpa"][4], False)
                b_ours, b_sdpa = tflops(results["ours"][5], True), tflops(results["sdpa"][5], True)
                configs = " / ".join(
                    f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
                    for c in (_attn_fwd_kernel.best_config, _attn_bwd_dq_kernel.best_config,
                              _attn_bwd_dkdv_kernel.best_config))
                print(f"{seq:>6} {head_dim:>4} {str(causal):>6} {batch:>3} {heads:>3} | {f_ours:>9.1f} {f_sdpa:>9.1f} "
                      f"{f_ours / f_sdpa:>6.2f} | {b_ours:>9.1f} {b_sdpa:>9.1f} {b_ours / b_sdpa:>6.2f} | "
                      f"{diff:>11.1e}{'!' if not diff <= args.tolerance else ' '} | {configs}", flush=True)
                del q, k, v, dout, results
                torch.cuda.empty_cache()
    if failed:
        print(f"FAILED: outputs or gradients differ from SDPA by more than {args.tolerance} (rows marked !)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
