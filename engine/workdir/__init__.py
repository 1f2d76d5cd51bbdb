"""What a run keeps in its workdir, and reads back to resume.

  run_dir.py     the directory itself (local or gs://), config.json written and read back
  lock.py        one run per workdir at a time
  tokenizer.py   the copy of the tokenizer the run trained with
  shard_sets.py  the identity of the shard sets the run trains on
  checkpoint.py  Orbax checkpoints of the state and the data position, checked on restore
  checksums.py   the size and CRC-32 of a checkpoint's files, and the damage they show
  checkpoint_tiers.py  the local tier beside the workdir's, and which one a restart resumes from
  resume.py      a run's start: the workdir held, the checkpoint resumed or the fresh state,
                 config.json with its records
  summary.py     summary.json and the loss curve, written at the end
"""
