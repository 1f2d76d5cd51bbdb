"""Hugging Face transformers itself, as the reference for `python -m engine.analysis.hf_check`:
tiny random models of the Llama family's architectures, their logits, and the logits of the
checkpoints the engine exports.

hf_check starts this script as a child process with a Python that has torch and transformers
(>= 5), so that the engine's process never imports torch:

  PYTHON engine/analysis/references/hf_reference.py [--threads N]

It imports neither jax nor anything from `engine`.

Families (all float32, 2 layers, hidden 64, 4 heads, 2 key/value heads, MLP 128, vocabulary
256, 128 positions; every weight random, RMSNorm scales and biases too, which transformers
initialises to one and zero, so that a norm or a bias the engine dropped would show):
  llama2   LlamaForCausalLM, default rotary (theta 10000)
  llama3   LlamaForCausalLM, rope_type llama3 (factor 8, low / high frequency factors 1 / 4,
           original_max_position_embeddings 64, theta 500000: with head_dim 16 one frequency
           is kept, one interpolated between the two wavelength bounds (16 and 64) and the
           rest divided by the factor, so all three branches of the scaling count)
  mistral  MistralForCausalLM, sliding_window 8 (shorter than the checks' 16 tokens)
  qwen2    Qwen2ForCausalLM, biases on q / k / v
  qwen3    Qwen3ForCausalLM, RMSNorm on each query and key head, head_dim 32 (not 64 / 4),
           the output head tied to the embedding (as the small Qwen3 checkpoints are)
  mixtral  MixtralForCausalLM, 4 experts of hidden 128, 2 per token (per-expert tensors on disk)
  qwen3_moe  Qwen3MoeForCausalLM, 4 experts of hidden 32 (moe_intermediate_size), 2 per token,
           norm_topk_prob, q / k norms, head_dim 32
  gemma2   Gemma2ForCausalLM: head_dim 16, query_pre_attn_scalar 24, attention and final logit
           soft caps 4 and 5 (small enough to bite), every other layer local (a window of 8,
           shorter than the checks' 16 tokens), the head tied to the embedding
  gemma3   Gemma3ForCausalLM: 4 layers, every third global; q / k norms; the local layers'
           rotary base 10000, the global ones' 1000000 scaled linearly by 8 (as Gemma 3 4B and
           up); query_pre_attn_scalar 24, the head tied
  deepseek_v3  DeepseekV3ForCausalLM: latent attention (kv latent 16, query latent 24, key part
           16 + rotary 8, values 12, interleaved rotary pairs; rms_norm_eps 1e-5 against the
           latent norms' 1e-6), 8 experts of hidden 32 in 4 groups, 2 per token from the best
           2 groups, scale 2.5, one shared expert; 3 layers, the first dense (MLP 128:
           first_k_dense_replace 1), the other two sparse; the router's correction
           bias random N(0, 0.1^2) (transformers starts it at zero), so a bias left out shows

Config formats: `v5` is what transformers 5's save_pretrained writes (`rope_parameters`);
`legacy` is the same checkpoint with config.json rewritten in the older format: a top-level
`rope_theta`, `rope_scaling` = the other rotary settings with their `rope_type` (null for the
default rotary), no `rope_parameters` (Gemma 3: the global layers' in those, the local layers'
base as `rope_local_base_freq`).

Protocol on stdin / stdout: after importing torch and transformers it prints one line of JSON,
{"ready": true, "torch": VERSION, "transformers": VERSION}. Then one JSON command per line, one
JSON reply per line ({"error": "..."} if the command failed):

  {"cmd": "make", "family": F, "dir": D, "formats": [...], "tokens": [[...]], "seed": S}
      builds family F's random model (torch seed S), saves it with save_pretrained, writes
      D/FORMAT/ (config.json in that format, model.safetensors) for every format, loads each
      back with AutoModelForCausalLM.from_pretrained and writes its logits on `tokens` (int,
      [B, L]) to D/FORMAT/reference_logits.npy (float32 [B, L, V]). Reply: {"formats": {FORMAT:
      {"dir", "warnings", "max_diff_to_built": the reloaded model's logits against the built
      one's}}, "architecture", "parameters"}.
  {"cmd": "logits", "dir": D, "tokens": [[...]]}
      from_pretrained(D), its logits to D/transformers_logits.npy. Reply: {"logits": PATH,
      "warnings": [...], "architecture"}.
  {"cmd": "quit"} (or end of input) exits with status 0.

"warnings" are what transformers said while loading: its logger's warnings and errors, Python
warnings, and anything printed (progress bars are switched off first).
"""

import argparse
import json
import os
import shutil
import sys

import numpy as np
import torch
import transformers
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Gemma2Config, Gemma3TextConfig,
                          LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen3Config,
                          Qwen3MoeConfig)

from transformers_output import captured_warnings  # A sibling file: this runs as a script.

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
              rms_norm_eps=1e-5, hidden_act='silu', tie_word_embeddings=False)
LLAMA3_ROPE = {'rope_type': 'llama3', 'factor': 8.0, 'low_freq_factor': 1.0,
               'high_freq_factor': 4.0, 'original_max_position_embeddings': 64,
               'rope_theta': 500000.0}
FAMILIES = {
    'llama2': lambda: LlamaConfig(**COMMON, rope_parameters={'rope_type': 'default',
                                                             'rope_theta': 10000.0}),
    'llama3': lambda: LlamaConfig(**COMMON, rope_parameters=dict(LLAMA3_ROPE)),
    'mistral': lambda: MistralConfig(**COMMON, sliding_window=8,
                                     rope_parameters={'rope_type': 'default',
                                                      'rope_theta': 1000000.0}),
    'qwen2': lambda: Qwen2Config(**COMMON, use_sliding_window=False,
                                 rope_parameters={'rope_type': 'default',
                                                  'rope_theta': 1000000.0}),
    'qwen3': lambda: Qwen3Config(**dict(COMMON, tie_word_embeddings=True), head_dim=32,
                                 use_sliding_window=False,
                                 rope_parameters={'rope_type': 'default',
                                                  'rope_theta': 1000000.0}),
    'mixtral': lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                     sliding_window=None,
                                     rope_parameters={'rope_type': 'default',
                                                      'rope_theta': 1000000.0}),
    'qwen3_moe': lambda: Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32,
                                        norm_topk_prob=True, use_sliding_window=False,
                                        rope_parameters={'rope_type': 'default',
                                                         'rope_theta': 1000000.0}),
    'deepseek_v3': lambda: DeepseekV3Config(
        **dict(COMMON, num_key_value_heads=4, num_hidden_layers=3), kv_lora_rank=16,
        q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, n_routed_experts=8,
        num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
        norm_topk_prob=True, rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0}),
}
GEMMA = dict(COMMON, hidden_act='gelu_pytorch_tanh', hidden_activation='gelu_pytorch_tanh',
             tie_word_embeddings=True, query_pre_attn_scalar=24, sliding_window=8)
FAMILIES.update({
    'gemma2': lambda: Gemma2Config(**GEMMA, head_dim=16, attn_logit_softcapping=4.0,
                                   final_logit_softcapping=5.0,
                                   rope_parameters={'rope_type': 'default',
                                                    'rope_theta': 10000.0}),
    'gemma3': lambda: Gemma3TextConfig(
        **dict(GEMMA, num_hidden_layers=4), head_dim=16,
        layer_types=['sliding_attention', 'sliding_attention', 'full_attention',
                     'sliding_attention'],
        rope_parameters={'full_attention': {'rope_type': 'linear', 'factor': 8.0,
                                            'rope_theta': 1000000.0},
                         'sliding_attention': {'rope_type': 'default', 'rope_theta': 10000.0}}),
})
FORMATS = ('v5', 'legacy')


def randomize(model, seed):
  """Every parameter random and large enough to matter: matrices N(0, 1 / fan_in) (the
  embedding N(0, 1), the fused experts' [E, out, in] too; routers N(0, 1), so that no two
  experts come near a tie), RMSNorm scales (q / k norms included) uniform in [0.5, 1.5],
  biases N(0, 0.5^2); DeepSeek's router bias N(0, 0.1^2)."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if p.dim() >= 2:
        std = 1.0 if 'embed_tokens' in name or name.endswith('mlp.gate.weight') else (
            p.shape[-1] ** -0.5)
        p.copy_(torch.randn(p.shape, generator=generator) * std)
      elif name.endswith('norm.weight'):
        p.copy_(0.5 + torch.rand(p.shape, generator=generator))
      else:
        p.copy_(0.5 * torch.randn(p.shape, generator=generator))
    for name, b in model.named_buffers():
      if name.endswith('e_score_correction_bias'):  # A buffer: DeepSeek's router bias.
        b.copy_(0.1 * torch.randn(b.shape, generator=generator))


def legacy_config(config: dict) -> dict:
  """transformers 5's config.json in the older format: top-level rope_theta, rope_scaling."""
  config = dict(config)
  rope = dict(config.pop('rope_parameters'))
  if 'full_attention' in rope:  # Gemma 3: by layer type.
    config['rope_local_base_freq'] = rope['sliding_attention']['rope_theta']
    rope = dict(rope['full_attention'])
  config['rope_theta'] = rope.pop('rope_theta')
  config['rope_scaling'] = rope if rope.get('rope_type', 'default') != 'default' else None
  return config




def load(directory):
  """(model, warnings) of from_pretrained(directory), float32, in eval mode."""
  with captured_warnings() as said:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
  model.eval()
  return model, said


def logits(model, tokens) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()


def make(request):
  family, directory, tokens = request['family'], request['dir'], request['tokens']
  if family not in FAMILIES:
    raise ValueError(f'unknown family {family!r}; known: {", ".join(FAMILIES)}')
  torch.manual_seed(request.get('seed', 0))
  config = FAMILIES[family]()
  with captured_warnings():
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
  randomize(model, request.get('seed', 0))
  model.eval()
  built = logits(model, tokens)
  saved = os.path.join(directory, 'saved')
  with captured_warnings():
    model.save_pretrained(saved)
  with open(os.path.join(saved, 'config.json')) as f:
    written = json.load(f)
  if 'rope_parameters' not in written:
    raise ValueError(f'transformers {transformers.__version__} wrote no rope_parameters; '
                     'the v5 format needs transformers >= 5')
  reply = {'architecture': type(model).__name__,
           'parameters': sum(p.numel() for p in model.parameters()), 'formats': {}}
  for fmt in request['formats']:
    if fmt not in FORMATS:
      raise ValueError(f'unknown format {fmt!r}; known: {", ".join(FORMATS)}')
    out = os.path.join(directory, fmt)
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(saved, out)
    with open(os.path.join(out, 'config.json'), 'w') as f:
      json.dump(written if fmt == 'v5' else legacy_config(written), f, indent=2)
    reloaded, said = load(out)
    reference = logits(reloaded, tokens)
    np.save(os.path.join(out, 'reference_logits.npy'), reference)
    np.save(os.path.join(out, 'tokens.npy'), np.asarray(tokens, np.int32))
    reply['formats'][fmt] = {'dir': out, 'warnings': said,
                             'max_diff_to_built': float(np.abs(reference - built).max())}
  shutil.rmtree(saved)
  return reply


def export_logits(request):
  model, said = load(request['dir'])
  path = os.path.join(request['dir'], 'transformers_logits.npy')
  np.save(path, logits(model, request['tokens']))
  return {'logits': path, 'warnings': said, 'architecture': type(model).__name__}


COMMANDS = {'make': make, 'logits': export_logits}


def serve(stdin, stdout) -> int:
  for line in stdin:
    if not line.strip():
      continue
    try:
      request = json.loads(line)
      if request.get('cmd') == 'quit':
        break
      if request.get('cmd') not in COMMANDS:
        raise ValueError(f'unknown command {request.get("cmd")!r}; known: '
                         f'{", ".join(COMMANDS)}, quit')
      reply = COMMANDS[request['cmd']](request)
    except Exception as error:  # pylint: disable=broad-except
      reply = {'error': f'{type(error).__name__}: {error}'}
    stdout.write(json.dumps(reply) + '\n')
    stdout.flush()
  return 0


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--threads', type=int, default=os.cpu_count())
  args = parser.parse_args(argv)
  torch.set_num_threads(args.threads)
  transformers.utils.logging.disable_progress_bar()
  stdout = sys.stdout
  sys.stdout = sys.stderr  # Only the protocol goes to the real stdout.
  stdout.write(json.dumps({'ready': True, 'torch': torch.__version__,
                           'transformers': transformers.__version__}) + '\n')
  stdout.flush()
  return serve(sys.stdin, stdout)


if __name__ == '__main__':
  sys.exit(main())
