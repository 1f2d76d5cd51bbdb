"""Supervised fine-tuning of a downloaded Hugging Face checkpoint on conversations, the loss on
the assistant's answers only.

  # 1. The conversations (JSON lines, Parquet or a datasets directory whose records hold a list
  #    of {role, content} messages), rendered with the checkpoint's chat template:
  python -m engine.data.prepare --input=chats.jsonl --messages_field=messages --tokenizer=hf \
      --tokenizer_path=/models/Qwen2.5-0.5B-Instruct/tokenizer.json --out=/tmp/chat_shards
  # 2. Fine-tune from the checkpoint on them:
  python -m engine.main --config=experiments/sft_hf.py:hf=/models/Qwen2.5-0.5B-Instruct,data=/tmp/chat_shards \
      --workdir=/tmp/sft
  #    or with LoRA adapters, the base frozen (add --config.model.lora_rank=16; docs/training.md,
  #    "LoRA"), exported merged or, with --adapters=peft, as a PEFT adapter.
  # 3. The held-out conversations' answer loss, and the export:
  python -m engine.evaluate --workdir=/tmp/sft
  python -m engine.export --workdir=/tmp/sft --out=/tmp/sft_hf

The set's tokens are transformers' `apply_chat_template` ids of each conversation, the ones
outside the answers flagged as context (engine/data/chat.py). Conversations are packed into
windows with document masking, so attention, positions and the loss stay within each, and the
loss is the mean over the answers' tokens of the whole batch, in either mode and on any mesh
(engine/models/documents.py). Everything else is experiments/finetune_hf.py's: the model, its
tokenizer and vocabulary from DIR, bfloat16 compute with float32 parameters, full remat.

Defaults: sequence 1024, global batch 16, AdamW lr 1e-5 (warmup 10, cosine to 1e-6), weight
decay 0.0, 200 steps. Not yet measured on an accelerator: no memory, loss or tokens/s are
claimed here.

Arguments (comma separated): hf=DIR and data=SHARDS (required), mode=auto|manual,
mesh=DxFxT[xC[xS[xE]]], steps=N.
"""

from engine.config import apply_run_args, parse_run_arg
from engine.errors import ConfigError
from experiments import finetune_hf


def get_config(arg=None):
  args = parse_run_arg(arg, steps=200, hf='', data='')
  if not args.data:
    raise ConfigError('experiments/sft_hf.py needs data=DIR, a shard set of conversations '
                      '(python -m engine.data.prepare --messages_field=messages ...), e.g. '
                      '--config=experiments/sft_hf.py:hf=/models/Qwen2.5-0.5B-Instruct,'
                      'data=/tmp/chat_shards.')
  config = finetune_hf.get_config(f'hf={args.hf},steps={args.steps}')
  config.data.source = 'shards'
  config.data.shards = args.data
  config.data.document_masking = True  # The loss stays within each conversation.
  config.data.seq_len = 1024

  config.optim.learning_rate = 1e-5
  config.optim.end_learning_rate = 1e-6
  config.optim.warmup_steps = 10
  return apply_run_args(config, args)
