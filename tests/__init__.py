"""The test suite, one folder per kind of proof (what each file proves: tests/README.md)."""
