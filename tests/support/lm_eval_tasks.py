"""lm-eval tasks on local files (no hub), one of each request type, written by `write(directory)`:
arithmetic questions as multiple choice (log-likelihoods), as a continuation to score (its
perplexity and greedy match), as a question to answer (generation), and text for a rolling
perplexity."""

import json
import os
import random

TASKS = ('engine_arith_choice', 'engine_arith_target', 'engine_arith_answer', 'engine_text_ppl')


def _docs(count: int, seed: int = 0) -> list[dict]:
  rng = random.Random(seed)
  docs = []
  for _ in range(count):
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    wrong = sorted({a + b + d for d in (-10, -1, 1, 10)} - {a + b})[:3]
    choices = [f' {a} + {b} = {v}.' for v in [a + b] + wrong]
    order = rng.sample(range(4), 4)
    docs.append({'question': f'User: What is {a} + {b}?\nAssistant:',
                 'answer': f' {a} + {b} = {a + b}.', 'choices': [choices[i] for i in order],
                 'label': order.index(0),
                 'text': f'The sum of {a} and {b} is {a + b}, and {b} plus {a} is too.'})
  return docs


def write(directory: str, count: int = 24) -> str:
  """The tasks' YAML files and data in `directory`; returns it (lm-eval's --include_path)."""
  os.makedirs(directory, exist_ok=True)
  data = os.path.join(directory, 'arith.jsonl')
  with open(data, 'w') as f:
    f.writelines(json.dumps(doc) + '\n' for doc in _docs(count))
  common = (f'dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n'
            'test_split: test\n')
  tasks = {
      'engine_arith_choice': 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\n'
                             'doc_to_choice: "{{choices}}"\ndoc_to_target: "{{label}}"\n'
                             'metric_list:\n  - metric: acc\n',
      'engine_arith_target': 'output_type: loglikelihood\ndoc_to_text: "{{question}}"\n'
                             'doc_to_target: "{{answer}}"\n'
                             'metric_list:\n  - metric: perplexity\n  - metric: acc\n',
      'engine_arith_answer': 'output_type: generate_until\ndoc_to_text: "{{question}}"\n'
                             'doc_to_target: "{{answer}}"\n'
                             'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 12\n'
                             '  do_sample: false\n'
                             'metric_list:\n  - metric: exact_match\n',
      'engine_text_ppl': 'output_type: loglikelihood_rolling\ndoc_to_text: ""\n'
                         'doc_to_target: "{{text}}"\nmetric_list:\n  - metric: word_perplexity\n'
                         '  - metric: byte_perplexity\n  - metric: bits_per_byte\n',
  }
  for name, body in tasks.items():
    with open(os.path.join(directory, f'{name}.yaml'), 'w') as f:
      f.write(f'task: {name}\n{common}{body}')
  return directory
