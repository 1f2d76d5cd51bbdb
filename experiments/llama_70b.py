"""A Llama-3-70B-shaped model for planning pod runs (python -m engine.plan; BUILD.md has the plan).

  python -m engine.plan --config=experiments/llama_70b.py --topology=v5p:16x16x16 \
      --meshes=1x256x16 --modes=auto,manual --out=/tmp/plan_70b

80 layers, width 8192, 64 heads of 128 (grouped-query: 8 key/value heads), SwiGLU MLP 28672,
rotary base 500,000, vocabulary 128,256, untied embedding and head: 70.6B parameters. Sequence
4096, global batch 1024 (4.2M tokens per step; v5p:16x16x16 has 1024 hosts and each takes whole
sequences), bfloat16 compute with float32 parameters and AdamW state, full remat. Synthetic
tokens: the shapes are the point (a real run brings its own data, --config.data.source=file).

Arguments (comma separated): mode=auto|manual, mesh=DxFxT[xC[xS[xE]]], steps=N,
batch=1024, seq=4096, layers=80, microbatches=1.
"""

from experiments.common import llama3_pod


def get_config(arg=None):
  return llama3_pod(arg, batch=1024, seq=4096, layers=80, embed_dim=8192, num_heads=64,
                    mlp_dim=28672, learning_rate=1.5e-4, end_learning_rate=1.5e-5)
