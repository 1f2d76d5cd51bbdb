"""Hugging Face checkpoints read and written (each family's format lives in engine/models/).

  load.py  a Hugging Face directory checked against the model, read slice by slice
  save.py  parameters, config and tokenizer written as a directory transformers loads
  lora_export.py  a LoRA run's adapters merged into the weights, or written as a PEFT adapter
"""
