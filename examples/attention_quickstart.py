"""End to end: attention variants through portakern on numpy and torch arrays.

Runs on any machine (the CPU reference serves numpy and CPU tensors; a GPU backend serves CUDA
tensors when one is present). Each result is checked against torch SDPA with an explicit mask.

    python examples/attention_quickstart.py
"""

import numpy as np
import torch
import torch.nn.functional as F

import portakern
from portakern.ir import expr as E


def sdpa_reference(q, k, v, keep=None):
    """float64 SDPA in BSHD layout, GQA by repeating kv heads, ``keep`` (Sq, Sk) boolean."""
    q, k, v = (torch.as_tensor(a).double().transpose(1, 2) for a in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=None if keep is None else torch.as_tensor(keep)
                                          ).transpose(1, 2).numpy()


def main():
    rng = np.random.default_rng(0)
    B, Sq, Sk, Hq, Hkv, D = 2, 5, 12, 8, 2, 64
    q = rng.standard_normal((B, Sq, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, Sk, Hkv, D)).astype(np.float32)
    v = rng.standard_normal((B, Sk, Hkv, D)).astype(np.float32)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    diag = i + Sk - Sq  # bottom-right alignment: the last query sees the last key

    # 1. plain, causal and sliding-window attention on numpy arrays (GQA: 8 query heads, 2 kv heads)
    for name, kwargs, keep in [("full", {}, None),
                               ("causal", {"causal": True}, j <= diag),
                               ("window (3, 0)", {"window": (3, 0)}, (j >= diag - 3) & (j <= diag))]:
        out = portakern.attention(q, k, v, **kwargs)
        err = np.abs(out - sdpa_reference(q, k, v, keep)).max()
        print(f"{name:16s} numpy {out.dtype} {out.shape}  max|err| vs SDPA {err:.1e}")
        assert err < 1e-5

    # 2. the same call on bf16 torch tensors returns bf16 torch tensors
    tq, tk, tv = (torch.from_numpy(a).bfloat16() for a in (q, k, v))
    out = portakern.attention(tq, tk, tv, causal=True)
    print(f"{'causal bf16':16s} torch {out.dtype} {tuple(out.shape)}")

    # 3. variants are expressions: a prefix-LM mask and ALiBi, written once for every backend
    out = portakern.attention(q, k, v, mask_mod=E.prefix_lm_mask(4),
                              score_mod=E.alibi_score(E.alibi_slopes(Hq)))
    print(f"{'prefix-LM+ALiBi':16s} numpy {out.shape}  finite={np.isfinite(out).all()}")

    # 4. decode over a paged KV cache: key t of sequence b lives in page block_table[b, t // 16]
    page, pages = 16, 8
    k_cache = rng.standard_normal((pages, page, Hkv, D)).astype(np.float32)
    v_cache = rng.standard_normal((pages, page, Hkv, D)).astype(np.float32)
    block_table = np.array([[5, 2, 7], [0, 3, 1]], dtype=np.int32)
    seqlens = np.array([40, 17], dtype=np.int32)
    q1 = q[:, -1:]
    out = portakern.attention(q1, k_cache, v_cache, block_table=block_table, seqlens_k=seqlens)
    for b in range(B):  # gather the pages back to dense keys and compare
        kb = k_cache[block_table[b]].reshape(-1, Hkv, D)[None, :seqlens[b]]
        vb = v_cache[block_table[b]].reshape(-1, Hkv, D)[None, :seqlens[b]]
        err = np.abs(out[b:b + 1] - sdpa_reference(q1[b:b + 1], kb, vb)).max()
        assert err < 1e-5, err
    print(f"{'paged decode':16s} numpy {out.shape}  matches the gathered dense keys")

    # 5. why that backend? explain() plans without running
    print()
    print(portakern.explain(portakern.attention, q, k, v, causal=True))


if __name__ == "__main__":
    main()
