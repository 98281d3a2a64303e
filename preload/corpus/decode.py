#!/usr/bin/env python3
"""Greedy transformer decode with a host sync per token (unmodified-style PyTorch).

A small GPT-style decoder made of torch.nn primitives (token and position nn.Embedding, per layer LayerNorm,
q/k/v/out nn.Linear, explicit softmax attention over a preallocated KV cache written with index_copy_ and
slicing, GELU MLP), fp32. Each step feeds the last token as a 1-element LongTensor on the device, applies a
repetition penalty through advanced indexing (index / index_put kernels, which carry device asserts), picks
the next token with argmax, gathers the chosen logit with torch.gather, and calls .item() (the host sync per
token). A step is one token.

stdout: `result <key> <sha256>` lines, then `steps`, `step_us` (median per token), `mean_us`.
Everything else goes to stderr.
"""

import argparse
import math
import statistics
import sys
import time

import common  # first: sets what must be set before torch loads (common.py)
from common import deterministic, pick_device, sha256, sync, tensor_bytes
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d_model, n_heads, max_len):
        super().__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.ln1 = nn.LayerNorm(d_model)
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.out = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d_model, d_model)
        self.register_buffer("k_cache", torch.zeros(n_heads, max_len, self.head_dim), persistent=False)
        self.register_buffer("v_cache", torch.zeros(n_heads, max_len, self.head_dim), persistent=False)

    def forward(self, x, pos, pos_t):
        # x: (1, d_model); pos: int; pos_t: (1,) LongTensor on the device holding pos.
        h = self.ln1(x)
        q = self.q(h).view(self.n_heads, 1, self.head_dim)
        k = self.k(h).view(self.n_heads, 1, self.head_dim)
        v = self.v(h).view(self.n_heads, self.head_dim)
        self.k_cache.index_copy_(1, pos_t, k)
        self.v_cache[:, pos] = v
        keys = self.k_cache[:, : pos + 1]  # (H, T, hd)
        values = self.v_cache[:, : pos + 1]  # (H, T, hd)
        att = torch.matmul(q, keys.transpose(1, 2)) * self.scale  # (H, 1, T)
        att = torch.softmax(att, dim=-1)
        o = torch.matmul(att, values)  # (H, 1, hd)
        x = x + self.out(o.reshape(1, self.d_model))
        x = x + self.fc2(self.act(self.fc1(self.ln2(x))))
        return x


class TinyGPT(nn.Module):
    def __init__(self, vocab, d_model, n_heads, n_layers, max_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, max_len) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.register_buffer("positions", torch.arange(max_len, dtype=torch.long), persistent=False)

    def forward(self, tok, pos):
        # tok: (1,) LongTensor on the device; returns logits (1, vocab).
        pos_t = self.positions[pos : pos + 1]
        x = self.tok_emb(tok) + self.pos_emb(pos_t)
        for block in self.blocks:
            x = block(x, pos, pos_t)
        return self.head(self.ln_f(x))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=64, help="timed tokens")
    ap.add_argument("--warmup", type=int, default=8, help="untimed tokens generated first")
    ap.add_argument("--prompt", type=int, default=8, help="prompt length (fed token by token, untimed)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--deterministic-algorithms", action="store_true",
                    help="torch.use_deterministic_algorithms(True) with CUBLAS_WORKSPACE_CONFIG=:4096:8 (read before argparse)")
    args = ap.parse_args()
    if args.steps < 1 or args.warmup < 0 or args.prompt < 1:
        ap.error("need --steps >= 1, --warmup >= 0, --prompt >= 1")

    deterministic(args.seed)
    device = pick_device(args.device)
    max_len = args.prompt + args.warmup + args.steps

    # Built on the CPU from the seed, then moved: the same weights whatever the device.
    model = TinyGPT(args.vocab, args.d_model, args.heads, args.layers, max_len)
    model = model.to(device).eval()
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(args.vocab, (args.prompt,), generator=gen).tolist()

    history = torch.zeros(max_len, dtype=torch.long, device=device)  # generated ids, on the device
    chosen_sum = torch.zeros((), dtype=torch.float32, device=device)
    tokens = []
    times = []

    with torch.no_grad():
        pos = 0
        for t in prompt[:-1]:
            model(torch.tensor([t], dtype=torch.long, device=device), pos)
            pos += 1
        last = prompt[-1]
        logits = None
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            logits = model(torch.tensor([last], dtype=torch.long, device=device), pos)
            n = len(tokens)
            if n:
                seen = history[:n]
                logits[0, seen] = logits[0, seen] - 1.0  # repetition penalty: index + index_put_
            idx = logits.argmax(-1)  # (1,)
            chosen = torch.gather(logits, 1, idx.unsqueeze(1))  # (1, 1)
            chosen_sum += chosen.squeeze()
            history[n : n + 1] = idx
            last = int(idx.item())  # the host sync per token
            tokens.append(last)
            pos += 1
            t1 = time.perf_counter()
            if i >= args.warmup:
                times.append((t1 - t0) * 1e6)
        sync(device)

    print(f"decode.py: generated {tokens}", file=sys.stderr)
    print(f"result tokens {sha256(','.join(map(str, tokens)).encode())}")
    print(f"result logits {sha256(tensor_bytes(logits))}")
    print(f"result chosen_logit_sum {sha256(tensor_bytes(chosen_sum))}")
    print(f"steps {len(times)}")
    print(f"step_us {statistics.median(times):.3f}")
    print(f"mean_us {statistics.fmean(times):.3f}")


if __name__ == "__main__":
    main()
