"""Load tests for any OpenAI-compatible server: ``ferry bench`` (see docs/loadtests.md)."""
