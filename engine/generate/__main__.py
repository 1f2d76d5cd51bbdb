"""The command line of engine.generate: `python -m engine.generate --workdir=RUN --prompt=TEXT`
(the sampling itself: engine/generate/sampling.py)."""

from absl import flags

from engine import config as config_lib
from engine.assemble import assemble_finished_run
from engine.cli.command_line import add_bos_flag, run_command
from engine.data.text_files import read_text
from engine.errors import ConfigError
from engine.generate.sampling import (DEFAULT_NEW_TOKENS, DEFAULT_TEMPERATURE, DEFAULT_TOP_K,
                                      Generator, Sampling, check_sampling_flags,
                                      prompts_and_slots, resolve_new_tokens)
from engine.workdir.checkpoint import restore_params

_WORKDIR = flags.DEFINE_string('workdir', None, 'The training run to sample from.')
_PROMPT = flags.DEFINE_string('prompt', None, 'A prompt.')
_PROMPTS_FILE = flags.DEFINE_string('prompts_file', None, 'A file of prompts, one per line.')
_MAX_NEW = flags.DEFINE_integer(
    'max_new_tokens', 0, f'New tokens per sample (0: {DEFAULT_NEW_TOKENS}; for GPT, what its '
    'learned positions leave after the prompt).')
_MAX_PROMPT = flags.DEFINE_integer(
    'max_prompt_len', 0, 'Prompt tokens, the beginning-of-text token not counted (0: the '
    'longest prompt\'s; for GPT its max_len - max_new_tokens, less one for a '
    'beginning-of-text token).')
_TEMPERATURE = flags.DEFINE_float('temperature', DEFAULT_TEMPERATURE, 'Softmax temperature of '
                                  'the draws; 0: greedy (the likeliest token every time).')
_TOP_K = flags.DEFINE_integer('top_k', DEFAULT_TOP_K, 'Sample among the k likeliest tokens (0: '
                              'all).')
_TOP_P = flags.DEFINE_float('top_p', 1.0, 'Sample within this probability mass.')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_NUM_SAMPLES = flags.DEFINE_integer('num_samples', 1, 'Samples per prompt.')
_MESH = flags.DEFINE_string('mesh', '1x1x1', f'Generation mesh {config_lib.MESH_FORMAT} (axes '
                            'not given are 1; its devices are the first ones).')
_ADD_BOS = add_bos_flag()


def main(argv):
  del argv
  texts = [_PROMPT.value] if _PROMPT.value is not None else []
  if _PROMPTS_FILE.value is not None:
    text = read_text(_PROMPTS_FILE.value, f'--prompts_file={_PROMPTS_FILE.value}')
    texts += [line for line in text.splitlines() if line.strip()]
  if not texts:
    raise ConfigError('give --prompt="..." or --prompts_file=FILE (one prompt a '
                      'line; it holds none).' if _PROMPTS_FILE.value else
                      'give --prompt="..." or --prompts_file=FILE.')
  sampling = Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value)
  check_sampling_flags(_MAX_NEW.value, _MAX_PROMPT.value, _NUM_SAMPLES.value, sampling)
  texts = [t for t in texts for _ in range(_NUM_SAMPLES.value)]
  run = assemble_finished_run(_WORKDIR.value, _MESH.value)
  config, tokenizer = run.config, run.tokenizer
  new_tokens = resolve_new_tokens(config, tokenizer, texts, _MAX_NEW.value, _MAX_PROMPT.value,
                                  _ADD_BOS.value)
  ids, slots = prompts_and_slots(config, tokenizer, texts, _MAX_PROMPT.value, new_tokens,
                                 _ADD_BOS.value)
  params = restore_params(_WORKDIR.value, run.setup.abstract_state()['params'])
  generator = Generator(run.setup, slots, new_tokens, sampling, tokenizer.vocab_size)
  outputs = generator.generate(params, ids, new_tokens, _SEED.value, tokenizer.eos_id)
  for text, out in zip(texts, outputs):
    print(f'--- {text!r}\n{text}{tokenizer.decode(out)}\n')


if __name__ == '__main__':
  run_command(main, 'engine.generate', required=('workdir',))
