"""A Llama-3-8B-shaped model for planning pod runs (python -m engine.plan) and for pods.

  python -m engine.plan --config=experiments/llama_8b.py --topology=v5p:4x4x8 \
      --meshes=8x16x1,1x32x4,1x16x1x1x8 --out=/tmp/plan_8b

32 layers, width 4096, 32 heads of 128 (grouped-query: 8 key/value heads), SwiGLU MLP 14336,
rotary base 500,000, vocabulary 128,256, untied embedding and head: 8.03B parameters, 6.98B of
them in the blocks. Sequence 8192, global batch 128 (1M tokens per step), bfloat16 compute with
float32 parameters and AdamW state, full remat. Synthetic tokens: the shapes are the point (a
real run brings its own data, --config.data.source=file).

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]], steps=N,
batch=128, seq=8192, layers=32, microbatches=1.
"""

from experiments.common import llama3_pod


def get_config(arg=None):
  return llama3_pod(arg, batch=128, seq=8192, layers=32, embed_dim=4096, num_heads=32,
                    mlp_dim=14336, learning_rate=3e-4, end_learning_rate=3e-5)
