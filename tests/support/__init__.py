"""What the tests share: tiny configs and reference runs, bad-input rows, the docs' command table,
the forking command runner, the multi-process experiment file. No tests here."""
