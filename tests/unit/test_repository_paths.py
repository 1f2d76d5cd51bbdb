"""A clone works anywhere: no tracked file names a path that exists only on one machine.

The rules, read off every tracked text file:
- nothing outside the repository: no path climbs out of it into a sibling folder (`../NAME/...`;
  a bad-input test's `../outside.safetensors`, a file its own scratch directory resolves, is no
  folder); the data the docs and tests use ships inside it (experiments/data/);
- no path under the folder this clone lives in, or the one above it (a build machine's folders:
  whatever they are called there, the test reads them off its own location);
- no home directory (/home/NAME, /root/..., /Users/NAME) and nothing under the top-level
  folders a machine keeps its own installs, mounts and workspaces in (MACHINE below), but the
  example /opt/torch-venv/bin/python, which the error lines name as "e.g.".
Placeholders are allowed as such: scratch paths under /tmp/, gs://bucket/..., /path/to/..., and
the user's own machines in examples of a cluster or a checkpoint (/models/, /data/, /shared/,
/local/, /ckpt/); the default cache paths are written with ~ and are not absolute.
"""

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]

# A path where one starts: after a space, =, a quote, a bracket, a backtick or a colon.
_START = r'(?:^|(?<=[\s=\'"`(\[,:]))'
MACHINE = re.compile(_START + r'/(?:home/\w|root/|Users/\w|opt/(?!torch-venv/)|mnt/|work/|srv/)'
                     r'[\w./*-]*', re.MULTILINE)
# A climb out of the repository into a sibling folder.
SIBLING = re.compile(r'(?<![\w./])\.\./[A-Za-z_][\w.-]*/')


def _tracked_texts():
  names = subprocess.run(['git', 'ls-files'], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split('\n')
  for name in filter(None, names):
    path = ROOT / name
    # This file plants the paths its rules refuse; the datasets directory is binary data.
    if (name.startswith('tests/support/datasets_dir/') or not path.is_file() or
        name == 'tests/unit/test_repository_paths.py'):
      continue
    try:
      yield name, path.read_text()
    except UnicodeDecodeError:  # Binary data.
      continue


def offending_paths(text: str) -> list[str]:
  """The paths of `text` that break the rules (the module docstring)."""
  here = [str(ROOT), str(ROOT.parent) + '/']
  return (SIBLING.findall(text) + MACHINE.findall(text) +
          [where for where in here if where in text])


def test_no_tracked_file_names_a_path_of_one_machine():
  bad = {}
  for name, text in _tracked_texts():
    found = offending_paths(text)
    if found:
      bad[name] = sorted(set(found))[:5]
  assert not bad, f'paths that exist only on one machine, by file: {bad}'


def test_the_rules_see_the_paths_they_refuse():
  sibling = '../' + 'shared/'  # Built, so that no scan of the tree finds it in this file.
  assert offending_paths(f'--config.data.path={sibling}data/t.txt') == [sibling]
  assert offending_paths("CACHE = '/home/alice/.cache/x'") == ['/home/alice/.cache/x']
  assert offending_paths('python /root/venv/bin/python') == ['/root/venv/bin/python']
  assert offending_paths('see `/srv/build/x.py`') == ['/srv/build/x.py']
  assert f'{ROOT.parent}/' in offending_paths(f'cd {ROOT.parent}/other')
  assert not offending_paths('--workdir=/tmp/run gs://bucket/run ~/.cache/engine /models/Qwen '
                             "'../outside.safetensors' sub/../../x /opt/torch-venv/bin/python")


def test_the_docs_data_ships_in_the_repository():
  text = ROOT / 'experiments' / 'data' / 'tinyshakespeare.txt'
  assert text.stat().st_size > 1_000_000 and text.read_text().startswith('First Citizen:')
  named = [name for name, body in _tracked_texts()
           if 'experiments/data/tinyshakespeare.txt' in body]
  assert len(named) >= 10, named  # The docs, experiments and tests read it from there.
