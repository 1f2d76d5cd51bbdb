"""Every command's command line.

  argv.py          flags read off argv without a parser (the checks before absl, the sweep, the
                   launchers) and `fail`, the one `error:` line; standard library only
  command_line.py  flags parsed, bad input as one `error:` line, `run_command` (every command's
                   app.run), the flags commands share
  config_help.py   --print_config, the schema's one-line help, did-you-mean for unknown keys
  usage.py         what --help prints: each command's usage line and what it does
"""
