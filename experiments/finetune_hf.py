"""Fine-tune a downloaded Hugging Face checkpoint (Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3,
Gemma 2 / 3) on your text, evaluate it and export it back to the Hugging Face format.

  # 1. Train from the checkpoint, with its own tokenizer, on a text file:
  python -m engine.main --config=experiments/finetune_hf.py:hf=/models/Qwen2.5-0.5B,steps=200 \
      --config.data.path=experiments/data/tinyshakespeare.txt --workdir=/tmp/finetune
  #    or on shards written with the checkpoint's tokenizer (engine.data.prepare
  #    --tokenizer=hf --tokenizer_path=/models/Qwen2.5-0.5B/tokenizer.json --out=/tmp/shards):
  python -m engine.main --config=experiments/finetune_hf.py:hf=/models/Qwen2.5-0.5B \
      --config.data.source=shards --config.data.shards=/tmp/shards --workdir=/tmp/finetune
  # 2. Evaluate and sample:
  python -m engine.evaluate --workdir=/tmp/finetune \
      --text_file=experiments/data/tinyshakespeare.txt
  python -m engine.generate --workdir=/tmp/finetune --prompt="ROMEO:" --max_new_tokens=50
  # 3. Export (loads with transformers' AutoModelForCausalLM and AutoTokenizer):
  python -m engine.export --workdir=/tmp/finetune --out=/tmp/finetune_hf

hf=DIR is a directory as `huggingface-cli download` leaves it: config.json, *.safetensors (one
file or several with model.safetensors.index.json) and tokenizer.json (or a SentencePiece
tokenizer.model). The model's sizes, rotary settings, biases and norms come from DIR/config.json
(engine/models/formats/llama.py); anything the engine does not compute exactly is refused before
anything loads. The vocabulary is the checkpoint's. Parameters load slice by slice into their
shardings, so a model larger than one device's memory loads on a mesh that splits it (e.g.
mesh=1x8x1 for FSDP over 8 devices).

Defaults: sequence 512, global batch 16, AdamW lr 2e-5 (warmup 20, cosine to 2e-6), weight decay
0.0, bfloat16 compute with float32 parameters and optimizer state, full remat. Hardware: one or
more accelerators. Not yet measured on an accelerator: no memory, loss or tokens/s are claimed
here.

Arguments (comma separated): hf=DIR (required), mode=auto|manual, mesh=DxFxT[xC[xS[xE]]],
steps=N.
"""

import os

from engine.config import apply_run_args, default_config, parse_run_arg

from engine.errors import ConfigError


def get_config(arg=None):
  args = parse_run_arg(arg, steps=200, hf='')
  if not args.hf:
    raise ConfigError('experiments/finetune_hf.py needs hf=DIR, the downloaded checkpoint, e.g. '
                      '--config=experiments/finetune_hf.py:hf=/models/Qwen2.5-0.5B.')
  config = default_config()
  config.model.name = 'llama'  # The checkpoint's config.json decides the rest.
  config.model.dtype = 'bfloat16'
  config.model.remat = 'full'
  config.train.init_from = f'hf:{args.hf}'

  config.data.source = 'file'
  config.data.path = ''  # --config.data.path=TEXT, or data.source=shards
  sentencepiece = os.path.join(args.hf, 'tokenizer.model')
  if os.path.isfile(sentencepiece) and not os.path.isfile(
      os.path.join(args.hf, 'tokenizer.json')):
    config.data.tokenizer, config.data.tokenizer_path = 'sentencepiece', sentencepiece
  else:
    config.data.tokenizer = 'hf'
    config.data.tokenizer_path = os.path.join(args.hf, 'tokenizer.json')
  config.data.seq_len = 512
  config.data.global_batch_size = 16

  config.optim.learning_rate = 2e-5
  config.optim.end_learning_rate = 2e-6
  config.optim.warmup_steps = 20
  config.optim.weight_decay = 0.0

  config.train.log_every = 10
  config.train.eval_every = 100
  config.train.eval_batches = 4
  config.train.checkpoint_every = 100
  return apply_run_args(config, args)
