"""Chunked KDA as Pallas kernels, in two families (`KernelOptions.family`).

The "tpu" family (`tpu`: the pallas_calls and their `jax.custom_vjp`;
`tpu_chunk`: the per-chunk math on 2-D values) is written for a TPU core:
one forward and one backward kernel, several heads per program, the
bounded gate only, and the raw inputs prepared in the kernels
(`calls.kda_tpu`; `chunk_kda` takes it when `calls.uses_tpu_family`).
`calls.kda_pallas` runs every other case on canonical inputs with the
"generic" family, described below: one source for TPU (Mosaic) and GPU
(Triton).

Modules of the generic family: `options` (`KernelOptions`, per-platform
defaults, shared), `helpers` (in-kernel ops, recurrence drivers), `chunk`
(per-chunk math shared by forward and backward), `forward` and `backward`
(the kernels), `calls` (pallas_calls, `jax.custom_vjp`, `kda_pallas`).

The math is the chunked WY/UT form of `xla.py` (derived in docs/kda.md),
split into kernels as FLA's chunk_kda does:
the heavy intra-chunk work runs in parallel over chunks, and only a light
recurrence walks the chunks in order. Forward:

  1. `forward.intra_kernel`, grid (B, H, T/C): per chunk of C=64 tokens, in
     sub-blocks of c=16 rows (i, j index sub-blocks; r, s rows):
     L        = gate cumulated from max(sub-block start, segment start) to
                each row: a [c,c] masked lower-triangular matmul (Mosaic TPU
                cannot lower `cumsum`); tot = L at each sub-block's last row.
     Aqk, Akk = decayed products sum_d x_r k_s exp(G_r - G_s) over
                same-segment pairs. Off-diagonal sub-blocks factorise as
                exp(L_r) exp(tot between) exp(tot_j - L_s), every exponent
                <= 0; diagonal sub-blocks use the exact pairwise decay one
                column at a time, the exponent (not the result) masked.
     P        = (I + diag(beta) Akk)^-1: forward substitution on the 16x16
                diagonal blocks (rank-1 updates), matmuls for the others.
     w, u     = P (beta k exp(G)) [first segment rows], P (beta v);
     and q exp(G), k exp(G_last - G), Dv = exp(G_last) [no reset], Aqk.
  2. `forward.recur_step` over the chunks in order (see `calls._recurrence`: a
     `fori_loop` per (B, H, V block) program on GPU, an "arbitrary" grid
     axis with the state in VMEM scratch on TPU), carrying the [K,V]
     float32 state: v_new = u - w S,  S' = Dv S + (k exp(G_last - G))^T
     v_new [rows of the chunk's last segment]; saves each chunk's entering
     S.
  3. `forward.out_kernel`, grid (B, H, T/C): o = (q exp(G)) S + Aqk v_new.

Segments: the kernels read a float32 run index per token (`run =
cumsum(reset)`, exact below 2^24) and the reset flags, and build every
same-segment, first-segment and last-segment mask in-kernel. Padding tokens
arrive with q, k, v, g, beta = 0 and are transparent.

Backward, five kernels (FLA splits its backward likewise, so that no kernel
holds the state and the intra-chunk work at once):
`backward.out_bwd_kernel` (per chunk: Aqk^T do and (q exp(G))^T do, the
parts that do not depend on dS), `backward.recur_bwd_step` (chunks in
reverse: dv_new = Aqk^T do + (k E) dS', dS = Dv dS' + (q F)^T do - w^T
dv_new; saves each chunk's dS' and dv_new), `backward.state_bwd_kernel`
(per chunk, the products with S and dS'), `backward.wy_bwd_kernel` (per
chunk, through the WY representation from the forward's saved Akk and P as
[C,C] matrices: dv, dbeta, dX, dAkk) and `backward.chunk_bwd_kernel` (per
chunk and block of K columns: dq, dk, dg through the decays, derived in
`backward._decay_bwd`). `jax.custom_vjp` joins them; everything around the
kernels (gates, l2norm, layout) is differentiated by JAX. The V blocks of
the recurrences are independent columns of S and the K blocks of the last
kernel independent columns of q, k, g, so results do not depend on
`v_block`, `k_block` or the recurrence form (bit for bit).

Lowering constraints honoured by the kernel source (checked by cross-lowering
in tests/ops_kda_pallas_test.py): no `cumsum`, no value slicing (Triton has no
slice lowering: sub-blocks are loaded from refs, rows and columns extracted by
masked reductions), every in-kernel array a power of two in size and every dot
at least 16 wide (K and V are zero-padded to powers of two >= 16), blocks of
one chunk's rows (or full T in the GPU recurrences), with full K and V on
TPU (legal for its (8, 128) rule), float32 accumulation in every dot at the
precision `KernelOptions.precision` sets per platform. GPU kernels lower
through
Triton (`pallas.triton.CompilerParams`): Mosaic GPU targets warpgroup-level
Hopper kernels (64-row wgmma tiles, explicit shared-memory/TMA management) and
cannot take this generic block-level code with 16x16 solves; Triton lowers it
as is and also runs on pre-Hopper GPUs.
"""

from kda_lm.ops.kda.pallas import calls, helpers, options

CHUNK = helpers.CHUNK
SUB = helpers.SUB
MAX_HEAD_DIM = helpers.MAX_HEAD_DIM
KernelOptions = options.KernelOptions
for_platform = options.for_platform
default_options = options.default_options
kda_pallas = calls.kda_pallas
kda_tpu = calls.kda_tpu
uses_tpu_family = calls.uses_tpu_family
unsupported_reason = calls.unsupported_reason
