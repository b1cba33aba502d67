"""Text in and out: the tokenizer and chat template, the detokenizer, structured outputs, tool calls."""
