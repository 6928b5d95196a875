"""The prefix-reuse benchmark suite (see bench/README.md)."""
