"""Each model family's Hugging Face checkpoints: the tensor tables and config.json keys that
engine/hf/ reads and writes, registered in engine/models/__init__.py's HF_FORMATS.

  interface.py  HFTensor, HFFormat, UnsupportedCheckpoint: how a family describes its checkpoints
  llama.py      the Llama family's formats: Llama 2 / 3.x, Mistral, Qwen2 / 2.5, Qwen3
  llama_moe.py  its mixtures of experts: Mixtral, Qwen3-MoE
  gemma.py      Gemma 2 and Gemma 3 (text): the Llama with Gemma's options
  deepseek.py   DeepSeek-V3: latent attention, sigmoid-routed experts, dense first layers
"""
