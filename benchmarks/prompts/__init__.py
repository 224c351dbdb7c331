"""The prompt sets of the speculative-decoding benchmarks (grounded.jsonl, chat.jsonl) and the code that writes them
from the texts in grounded_texts.py: `python -m benchmarks.prompts.make_prompts [--check]`."""
