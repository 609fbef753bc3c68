"""Training check: a small GPT trained twice from the same seed, once with flash_cute attention
and once with PyTorch SDPA; the two loss curves must agree within bf16 noise.

    python examples/train_gpt.py --steps 300 --out docs/train_curve      # on the H200
    python examples/train_gpt.py --steps 5 --device cpu --attn sdpa        # smoke run

Data: a synthetic corpus with learnable structure (token t+1 depends on tokens t and t-7 through
fixed random tables, plus noise), so the loss falls well below log(vocab) and a broken
attention would show as a diverging curve. Writes <out>.json (both curves) and <out>.png.
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, heads, attn):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, dim // self.heads).unbind(2)
        if self.attn == "flash_cute":
            from flash_cute import flash_attn_func
            o = flash_attn_func(q, k, v, causal=True)           # (b, s, h, d) views, no copies
        else:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.transpose(1, 2), is_causal=True).transpose(1, 2)
        x = x + self.proj(o.reshape(b, s, dim))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab, dim, heads, layers, seqlen, attn):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seqlen, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attn) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def make_corpus(n_tokens, vocab, seed):
    """Tokens with long- and short-range structure: x[t] = T1[x[t-1]] + T2[x[t-7]] (mod V),
    replaced by a random token 10% of the time."""
    g = torch.Generator().manual_seed(seed)
    t1, t2 = (torch.randint(vocab, (vocab,), generator=g) for _ in range(2))
    x = torch.randint(vocab, (n_tokens,), generator=g)
    noise = torch.rand(n_tokens, generator=g) < 0.1
    for t in range(7, n_tokens):
        if not noise[t]:
            x[t] = (t1[x[t - 1]] + t2[x[t - 7]]) % vocab
    return x


def train(attn, args, corpus):
    torch.manual_seed(args.seed)  # same init and batches for both runs
    model = GPT(args.vocab, args.dim, args.heads, args.layers, args.seqlen, attn).to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(args.seed + 1)
    losses = []
    for step in range(args.steps):
        starts = torch.randint(len(corpus) - args.seqlen - 1, (args.batch,), generator=g)
        chunk = torch.stack([corpus[s:s + args.seqlen + 1] for s in starts]).to(args.device)
        with torch.autocast(args.device, dtype=torch.bfloat16):
            logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % max(args.steps // 10, 1) == 0:
            print(f"[{attn}] step {step:4d} loss {losses[-1]:.4f}", flush=True)
    return losses


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)      # head dim 128
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attn", nargs="+", default=["flash_cute", "sdpa"],
                    choices=["flash_cute", "sdpa"])
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.png")
    args = ap.parse_args()

    corpus = make_corpus(200_000, args.vocab, args.seed)
    curves, seconds = {}, {}
    for attn in args.attn:
        t0 = time.time()
        curves[attn] = train(attn, args, corpus)
        seconds[attn] = time.time() - t0
    tail = max(args.steps // 10, 1)
    summary = {a: sum(c[-tail:]) / tail for a, c in curves.items()}
    print("mean loss over the last", tail, "steps:",
          ", ".join(f"{a} {v:.4f}" for a, v in summary.items()),
          f"(log vocab = {math.log(args.vocab):.2f})")
    if len(curves) == 2:
        a, b = curves.values()
        gap = max(abs(x - y) for x, y in zip(a, b))
        print(f"max |loss difference| over all steps: {gap:.4f}; "
              f"final-window difference: {abs(summary[args.attn[0]] - summary[args.attn[1]]):.4f}")
    if args.out:
        with open(args.out + ".json", "w") as f:
            json.dump({"args": vars(args), "curves": curves, "seconds": seconds}, f)
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not installed: no plot")
            return
        fig, ax = plt.subplots(figsize=(7, 4))
        for attn, c in curves.items():
            ax.plot(c, label=attn, linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        ax.set_title(f"GPT {args.layers}x{args.dim}, {args.heads} heads, "
                     f"seqlen {args.seqlen}, bf16")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out + ".png", dpi=120)
        print("wrote", args.out + ".json", args.out + ".png")


if __name__ == "__main__":
    main()
