"""The PyTorch reference for the Shakespeare model: the same GPT, trained step by step in eager
PyTorch on the CPU, the way nanoGPT's well-known CPU run trains it.

`python -m engine.bench --torch_python=...` starts this script as a child process and interleaves
its steps with the engine's own on the Shakespeare configuration (experiments/shakespeare_char.py),
so that both see the same machine load. Run it with a Python that has torch, e.g. Debian's
python3-torch with /usr/bin/python3:

  /usr/bin/python3 engine/analysis/references/torch_reference.py --layers 4 --heads 4 --width 128 \
      --mlp 512 --vocab 72 --seq 64 --batch 12 --threads 2 [--no-tie] [--seed 0]

It imports neither jax nor anything from `engine`, and uses nothing newer than torch 1.13.

Debian's python3-torch is built with BLAS_INFO=generic: its matrix products go through whatever
libblas.so.3 the alternatives system picks, which is netlib's reference BLAS unless an optimised
one is installed (BUILD.md: a step many times slower). Install libopenblas0-openmp (or -pthread), or point LD_LIBRARY_PATH at its
openblas-openmp directory, before comparing anything with these timings.

The model matches engine/models/gpt.py: token + learned position embeddings, pre-LayerNorm blocks
(LayerNorm with scale and bias, eps 1e-5), causal multi-head attention from one fused qkv
projection without bias, 1/sqrt(head_dim) on the queries, an output projection without bias, a
GELU MLP (tanh approximation, jax.nn.gelu's default) whose two projections have biases, a final
LayerNorm and an output head tied to the token embedding (or its own matrix with --no-tie, no
bias). Initialisation: N(0, 0.02), the attention-out and MLP-down weights N(0, 0.02 / sqrt(2 x
layers)), LayerNorm scales one, biases zero. No dropout, float32 throughout.

A training step: cross-entropy of next-token predictions on a batch of random token windows,
backward, clipping to global norm 1.0, AdamW (lr 1e-3, betas 0.9 / 0.99, weight decay 0.1 on
matrices only, as the engine's weight_decay_on='matrices'; constant learning rate: the schedule
does not change the cost of a step).

Protocol on stdin / stdout: after building the model and two warm-up steps it prints `ready`.
Then, one command per line:
  step N   runs N steps, timing each whole step (forward, backward, clip, optimizer) with
           time.perf_counter(), and prints one line of JSON:
           {"step_ms": [N floats], "loss": <loss of the last step>, "params": <parameter count>}
  quit     (or end of input) exits with status 0.
"""

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class LayerNorm(nn.Module):
  """LayerNorm with a scale and a bias (the engine's, eps 1e-5)."""

  def __init__(self, dim, eps):
    super().__init__()
    self.weight = nn.Parameter(torch.ones(dim))
    self.bias = nn.Parameter(torch.zeros(dim))
    self.eps = eps

  def forward(self, x):
    return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class CausalSelfAttention(nn.Module):

  def __init__(self, width, heads, max_len):
    super().__init__()
    assert width % heads == 0
    self.heads = heads
    self.head_dim = width // heads
    self.qkv = nn.Linear(width, 3 * width, bias=False)
    self.out = nn.Linear(width, width, bias=False)
    mask = torch.tril(torch.ones(max_len, max_len, dtype=torch.bool))
    self.register_buffer('mask', mask.view(1, 1, max_len, max_len), persistent=False)

  def forward(self, x):
    B, L, D = x.shape
    q, k, v = self.qkv(x).split(D, dim=2)
    q = q.view(B, L, self.heads, self.head_dim).transpose(1, 2)  # B H L K
    k = k.view(B, L, self.heads, self.head_dim).transpose(1, 2)
    v = v.view(B, L, self.heads, self.head_dim).transpose(1, 2)
    q = q * (1.0 / math.sqrt(self.head_dim))  # Scaled on the queries, as the engine does.
    att = q @ k.transpose(-2, -1)  # B H L L
    att = att.masked_fill(~self.mask[:, :, :L, :L], torch.finfo(att.dtype).min)
    att = F.softmax(att, dim=-1)
    y = (att @ v).transpose(1, 2).contiguous().view(B, L, D)
    return self.out(y)


class MLP(nn.Module):

  def __init__(self, width, mlp):
    super().__init__()
    self.up = nn.Linear(width, mlp, bias=True)
    self.down = nn.Linear(mlp, width, bias=True)

  def forward(self, x):
    return self.down(F.gelu(self.up(x), approximate='tanh'))


class Block(nn.Module):
  """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, width, heads, mlp, max_len, eps):
    super().__init__()
    self.ln_attn = LayerNorm(width, eps)
    self.attn = CausalSelfAttention(width, heads, max_len)
    self.ln_mlp = LayerNorm(width, eps)
    self.mlp = MLP(width, mlp)

  def forward(self, x):
    x = x + self.attn(self.ln_attn(x))
    return x + self.mlp(self.ln_mlp(x))


class GPT(nn.Module):

  def __init__(self, vocab, layers, heads, width, mlp, max_len, tie=True, eps=1e-5,
               init_std=0.02):
    super().__init__()
    self.max_len = max_len
    self.tok_embed = nn.Embedding(vocab, width)
    self.pos_embed = nn.Embedding(max_len, width)
    self.blocks = nn.ModuleList(
        [Block(width, heads, mlp, max_len, eps) for _ in range(layers)])
    self.ln_final = LayerNorm(width, eps)
    self.head = nn.Linear(width, vocab, bias=False)
    if tie:
      self.head.weight = self.tok_embed.weight  # One parameter, used twice.

    residual_std = init_std / math.sqrt(2 * layers)  # GPT-2's scaled residual init.
    for name, p in self.named_parameters():
      if p.dim() < 2:
        continue  # LayerNorm scales (ones) and biases (zeros) keep their values.
      std = residual_std if name.endswith(('attn.out.weight', 'mlp.down.weight')) else init_std
      with torch.no_grad():
        p.normal_(0.0, std)
    for module in self.modules():
      if isinstance(module, nn.Linear) and module.bias is not None:
        with torch.no_grad():
          module.bias.zero_()

  def forward(self, tokens):
    B, L = tokens.shape
    assert L <= self.max_len
    pos = torch.arange(L, device=tokens.device)
    x = self.tok_embed(tokens) + self.pos_embed(pos)
    for block in self.blocks:
      x = block(x)
    return self.head(self.ln_final(x))


def make_optimizer(model, lr, betas, weight_decay):
  """AdamW with weight decay on matrices only (embeddings and weights; not norms or biases)."""
  params = list(model.parameters())  # Deduplicated: a tied head is one parameter.
  groups = [{'params': [p for p in params if p.dim() >= 2], 'weight_decay': weight_decay},
            {'params': [p for p in params if p.dim() < 2], 'weight_decay': 0.0}]
  # torch 1.13 has a fused AdamW only for CUDA; foreach (multi-tensor) is the fastest on CPU.
  try:
    return torch.optim.AdamW(groups, lr=lr, betas=betas, foreach=True)
  except TypeError:  # Older torch without the foreach argument.
    return torch.optim.AdamW(groups, lr=lr, betas=betas)


def parse_args(argv=None):
  """The model's shape and the run's settings from the command line (defaults: Shakespeare)."""
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--layers', type=int, default=4)
  parser.add_argument('--heads', type=int, default=4)
  parser.add_argument('--width', type=int, default=128)
  parser.add_argument('--mlp', type=int, default=512)
  parser.add_argument('--vocab', type=int, default=72)
  parser.add_argument('--seq', type=int, default=64)
  parser.add_argument('--max_len', type=int, default=-1,
                      help='position embeddings; -1: --seq (as experiments/shakespeare_char.py)')
  parser.add_argument('--batch', type=int, default=12)
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  parser.add_argument('--tie', dest='tie', action='store_true', default=True)
  parser.add_argument('--no-tie', dest='tie', action='store_false')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--lr', type=float, default=1e-3)
  parser.add_argument('--clip', type=float, default=1.0)
  return parser.parse_args(argv)


def make_train_step(model, optimizer, args):
  """One whole training step on a fresh random batch (forward, backward, clip, optimizer), so
  that a timed step covers all of it; returns the step's loss."""
  batches = torch.Generator().manual_seed(args.seed + 1)

  def train_step():
    tokens = torch.randint(args.vocab, (args.batch, args.seq + 1), generator=batches)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss

  return train_step


def serve(train_step, num_params):
  """The stdin / stdout protocol (see the module doc): `step N` runs and times N steps, `quit`
  or end of input ends; returns the exit status (2 on an unknown command)."""
  for line in sys.stdin:
    words = line.split()
    if not words:
      continue
    if words[0] == 'quit':
      break
    if words[0] != 'step' or len(words) != 2:
      print(f'torch_reference: unknown command {line.strip()!r} (expected: step N | quit)',
            file=sys.stderr, flush=True)
      return 2
    step_ms, loss = [], None
    for _ in range(int(words[1])):
      start = time.perf_counter()
      loss = train_step()
      step_ms.append((time.perf_counter() - start) * 1e3)
    print(json.dumps({'step_ms': step_ms, 'loss': None if loss is None else float(loss.item()),
                      'params': num_params}), flush=True)
  return 0


def main(argv=None):
  """Builds the model and optimizer, warms up with two steps, says `ready`, then serves."""
  args = parse_args(argv)
  torch.set_num_threads(args.threads)
  torch.manual_seed(args.seed)
  np.random.seed(args.seed)
  max_len = args.max_len if args.max_len > 0 else args.seq

  model = GPT(args.vocab, args.layers, args.heads, args.width, args.mlp, max_len, tie=args.tie)
  model.train()
  num_params = sum(p.numel() for p in model.parameters())
  optimizer = make_optimizer(model, args.lr, (0.9, 0.99), 0.1)
  train_step = make_train_step(model, optimizer, args)

  for _ in range(2):
    train_step()
  print('ready', flush=True)
  return serve(train_step, num_params)


if __name__ == '__main__':
  sys.exit(main())
